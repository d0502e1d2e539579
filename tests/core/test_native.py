"""The op's compiled CPU training node (lapheads.core.native): bit-identical to the Python node it replaces, used only
where built and enabled, and every way of not having it (not built, disabled, a library that does not load, no
compiler) leaves the op working on the Python node."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lapheads import laplacian_attention
from lapheads.cli import main
from lapheads.core import native
from lapheads.errors import InputError
from tests.conftest import node_name


@pytest.fixture(scope="module")
def node():
    """The compiled node, built into the user's cache where it is not yet (once per machine and torch, ~30 s)."""
    if not native.available():
        try:
            native.build()
        except InputError as err:
            pytest.skip(f"the compiled CPU node cannot be built here: {err}")
    assert native.module() is not None
    return native.module()


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """An empty native cache for one test; the real one is looked up again afterwards."""
    monkeypatch.setenv("LAPHEADS_NATIVE_DIR", str(tmp_path / "native"))
    native._load.cache_clear()
    yield tmp_path / "native"
    monkeypatch.undo()
    native._load.cache_clear()


def _inputs(h, hkv, t, s, seed=0, packed=False):
    gen = torch.Generator().manual_seed(seed)
    if packed:  # q, k, v as views of one (B, T, 3, H, D) projection, as timm's Attention makes them
        qkv = torch.randn(2, t, 3, h, 16, generator=gen).permute(2, 0, 3, 1, 4)
        return [x.detach().clone().requires_grad_() for x in qkv.unbind(0)]
    shapes = [(2, h, t, 16), (2, hkv, s, 16), (2, hkv, s, 16)]
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in shapes]


#: (H, Hkv, T, S, spec, is_causal, mask, packed): block layouts, GQA, KV cache, both mask kinds, strided inputs
CASES = [
    (6, 6, 37, 37, 2, False, None, False),
    (6, 6, 37, 37, 2, False, None, True),
    (6, 6, 20, 20, [True, False, True, True, False, False], True, None, False),
    (8, 2, 24, 24, [False] * 4 + [True] * 4, False, None, False),
    (8, 2, 9, 24, [False] * 4 + [True] * 4, True, None, False),
    (4, 4, 10, 25, 1, False, None, False),
    (6, 6, 30, 30, 3, False, "bool", False),
    (6, 6, 30, 30, 3, False, "float", False),
]


def _run(inputs, spec, is_causal, mask, grad, wanted=(0, 1, 2)):
    leaves = [x.detach().clone().requires_grad_(i in wanted) for i, x in enumerate(inputs)]
    out = laplacian_attention(*leaves, spec, is_causal=is_causal, attn_mask=mask)
    name = node_name(out.grad_fn)
    out.backward(grad)
    return name, [out.detach(), *(x.grad for x in leaves if x.requires_grad)]


@pytest.mark.parametrize("h, hkv, t, s, spec, is_causal, mask_kind, packed", CASES)
def test_the_compiled_node_matches_the_python_node_bit_for_bit(node, h, hkv, t, s, spec, is_causal, mask_kind, packed):
    inputs = _inputs(h, hkv, t, s, packed=packed)
    gen = torch.Generator().manual_seed(1)
    mask = None
    if mask_kind is not None:  # padding-like, with one query that sees no key
        mask = torch.rand(2, 1, t, s, generator=gen) > 0.3
        mask[0, 0, 1] = False
        if mask_kind == "float":
            mask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    grad = torch.randn(2, h, t, 16, generator=gen)
    compiled_name, compiled = _run(inputs, spec, is_causal, mask, grad)
    with native.disabled():
        python_name, python = _run(inputs, spec, is_causal, mask, grad)
    assert "LaplacianSDPA" in compiled_name and compiled_name.startswith("torch::autograd::CppNode")
    assert python_name == "LaplacianSDPABackward"
    for ours, theirs in zip(compiled, python, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("wanted", [(0,), (1,), (2,), (0, 2)])
def test_the_compiled_node_returns_only_the_gradients_asked_for(node, wanted):
    inputs = _inputs(6, 6, 12, 12)
    grad = torch.randn(2, 6, 12, 16)
    _, compiled = _run(inputs, 2, False, None, grad, wanted)
    with native.disabled():
        _, python = _run(inputs, 2, False, None, grad, wanted)
    assert len(compiled) == 1 + len(wanted)
    for ours, theirs in zip(compiled, python, strict=True):
        assert torch.equal(ours, theirs)


def test_the_compiled_node_frees_what_it_saved_and_retains_on_request(node):
    q, k, v = _inputs(6, 6, 12, 12)
    out = laplacian_attention(q, k, v, 2)
    out.sum().backward(retain_graph=True)
    first = q.grad.clone()
    out.sum().backward()  # retained: the same gradient again
    assert torch.equal(q.grad, 2 * first)
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()


def test_LAPHEADS_NATIVE_0_keeps_the_python_node(node):
    code = (
        "import torch; from lapheads import laplacian_attention\n"
        "q, k, v = (torch.randn(1, 4, 8, 16, requires_grad=True) for _ in range(3))\n"
        "f = laplacian_attention(q, k, v, 2).grad_fn\n"
        "print(f.name() if type(f).__name__ == 'CppFunction' else type(f).__name__)"
    )
    names = {}
    for flag in ("0", "1"):
        env = {**os.environ, "LAPHEADS_NATIVE": flag}
        names[flag] = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    assert names["0"] == "LaplacianSDPABackward"
    assert "LaplacianSDPA" in names["1"] and names["1"].startswith("torch::autograd::CppNode")


def test_not_built_means_the_python_node_and_status_says_how_to_build(own_cache):
    assert native.module() is None
    assert "not built (lapheads kernel build" in native.status()
    q, k, v = _inputs(6, 6, 12, 12)
    assert node_name(laplacian_attention(q, k, v, 2).grad_fn) == "LaplacianSDPABackward"


def _install(path, data: bytes, record: bytes | None = None) -> None:
    """A library at ``path`` with a build record (size and sha256) of ``record`` (default: of ``data``)."""
    import hashlib

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    path.write_bytes(data)
    vouched = data if record is None else record
    path.with_name(path.name + ".sha256").write_text(f"{len(vouched)} {hashlib.sha256(vouched).hexdigest()}\n")


def test_a_library_that_does_not_load_is_warned_about_once_and_not_used(own_cache):
    _install(native.library_path(), b"not a shared library")  # ours and as recorded, but not a library
    q, k, v = _inputs(6, 6, 12, 12)
    with pytest.warns(UserWarning, match="does not load.*lapheads kernel build --force"):
        out = laplacian_attention(q, k, v, 2)
    assert node_name(out.grad_fn) == "LaplacianSDPABackward"
    assert "does not load" in native.status()


@pytest.fixture
def built_library(node) -> bytes:
    """The real library as ``kernel build`` left it (read before a test swaps in its own cache)."""
    return native.library_path().read_bytes()


def _foreign(path) -> str:
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, 1, 1)  # daemon
    return "belongs to user id 1"


@pytest.mark.parametrize(
    "tamper",
    [
        ("world-writable file", lambda path: (os.chmod(path, 0o777), "writable by others")[1]),
        ("world-writable folder", lambda path: (os.chmod(path.parent, 0o777), "writable by others")[1]),
        ("another user's file", _foreign),
        ("no build record", lambda path: (path.with_name(path.name + ".sha256").unlink(), "is missing")[1]),
        ("cut short", lambda path: (path.write_bytes(path.read_bytes()[:4096]), "has 4096 bytes")[1]),
        ("swapped", lambda path: (path.write_bytes(b"x" * path.stat().st_size), "sha256 differs")[1]),
    ],
    ids=lambda t: t[0],
)
def test_a_cached_library_is_trusted_only_when_it_is_ours_and_as_built(built_library, own_cache, tamper):
    """Loading a library runs its code: a stranger's, a writable or a damaged one is one line, never loaded, never a
    signal (checked in a fresh process: a library cut short used to end every command with SIGBUS)."""
    path = native.library_path()
    _install(path, built_library)  # the real library, as built, in this test's own cache
    said = tamper[1](path)
    code = (
        "import warnings, torch; from lapheads import laplacian_attention; from lapheads.core import native\n"
        "q, k, v = (torch.randn(1, 4, 8, 16, requires_grad=True) for _ in range(3))\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    f = laplacian_attention(q, k, v, 2).grad_fn\n"
        "    name = f.name() if type(f).__name__ == 'CppFunction' else type(f).__name__\n"
        "print(name); print([str(w.message) for w in caught]); print(native.status())"
    )
    env = {**os.environ, "LAPHEADS_NATIVE_DIR": str(own_cache)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1000:]
    name, warned, status = done.stdout.strip().splitlines()
    assert name == "LaplacianSDPABackward" and said in warned and "not loading the compiled CPU node" in warned
    assert status.startswith("not trusted (") and said in status
    kernel = subprocess.run(
        [sys.executable, "-m", "lapheads", "kernel", "status"], env=env, capture_output=True, text=True, timeout=120
    )
    assert kernel.returncode == 0 and said in kernel.stdout


def test_a_disabled_node_is_never_loaded_even_to_report_it(own_cache):
    _install(native.library_path(), b"would crash if loaded")
    code = "from lapheads.core import native; print(native.status()); print(native._load.cache_info().currsize)"
    env = {**os.environ, "LAPHEADS_NATIVE_DIR": str(own_cache), "LAPHEADS_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-1] == "0" and "disabled" in done.stdout


def test_the_library_is_named_by_its_source_and_torch(own_cache, tmp_path, monkeypatch):
    path = native.library_path()
    assert torch.__version__ in path.parent.name and path.is_relative_to(own_cache)
    changed = tmp_path / "changed.cpp"
    changed.write_text(native._SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(native, "_SOURCE", changed)
    assert native.library_path() != path  # an edited source is never served by an old binary


def test_building_without_a_compiler_is_one_line_naming_it(own_cache, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(InputError, match="no C\\+\\+ compiler 'no-such-compiler'"):
        native.build()
    assert main(["kernel", "build"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lapheads kernel: error: no C++ compiler 'no-such-compiler'") and "\n" not in err
    assert not any(own_cache.rglob("*.so"))  # nothing half-written


def test_building_without_ninja_says_how_to_get_it(own_cache, monkeypatch):
    monkeypatch.setattr(native, "_path_with_ninja", lambda: str(own_cache / "empty"))
    with pytest.raises(InputError, match="ninja not found; allowed: pip install ninja"):
        native.build()


def test_kernel_status_is_one_line(own_cache, capsys):
    assert main(["kernel", "status"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("kernel: not built") and "\n" not in out


@pytest.mark.slow
def test_build_from_scratch_then_the_op_uses_it(own_cache):
    """The whole build (~30 s): compiled into a fresh cache, moved in place, loaded, used, equal to the Python node."""
    path = native.build()
    assert path.is_file() and not [p for p in path.parent.parent.iterdir() if p.name.startswith(".build-")]
    assert native.available()
    inputs, grad = _inputs(6, 6, 16, 16), torch.randn(2, 6, 16, 16)
    compiled_name, compiled = _run(inputs, 2, False, None, grad)
    with native.disabled():
        _, python = _run(inputs, 2, False, None, grad)
    assert compiled_name.startswith("torch::autograd::CppNode")
    for ours, theirs in zip(compiled, python, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("identity", ["filled"])
def test_a_padded_batch_with_T_equal_S_takes_the_one_node_path_whatever_the_identity_rule(node, identity):
    """transformers passes identity="filled" with every mask; with T == S that rule is "aligned" (each query is its
    own key), so a right-padded training batch gets the one-node path and the very same numbers."""
    q, k, v = _inputs(6, 6, 12, 12)
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    mask[1, :, :, 9:] = False  # right padding in the second row
    grad = torch.randn(2, 6, 12, 16)
    results = {}
    for rule in ("aligned", identity):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = laplacian_attention(*leaves, 2, attn_mask=mask, identity=rule)
        assert "LaplacianSDPA" in node_name(out.grad_fn)
        out.backward(grad)
        results[rule] = [out.detach(), *(x.grad for x in leaves)]
    for ours, theirs in zip(results["aligned"], results[identity], strict=True):
        assert torch.equal(ours, theirs)
