"""The op's compiled CPU training node: build it once (``lapheads kernel build``), then the op uses it by itself.

``laplacian_attention`` on the CPU, where SDPA runs its flash kernel and a gradient is wanted, calls that kernel and
its backward directly, with the Laplacian combine and gradient fix-ups around them. In Python that node
(``lapheads.core._autograd.LaplacianSDPA``) costs a Python ``autograd.Function`` forward and backward per call:
about 2% of a ViT-S attention step at B = 4, T = 197 (docs/benchmarks.md). ``csrc/laplacian_sdpa.cpp`` is the same
node in C++, step for step, so its outputs and gradients are bit-identical to the Python one's.

Design choices:

* **Built on request, never behind the user's back.** Compiling takes ~30 s and needs a C++ compiler and ninja
  (``pip install ninja``); ``lapheads kernel build`` (run by quickstart.sh) does it once. Until then, and wherever
  it cannot be built, the op uses the Python node: same numbers, slightly slower.
* **One build per source and torch.** The library lives in a cache folder named by the source's hash, torch's
  version and build, Python's version and the machine (``LAPHEADS_NATIVE_DIR``, default
  ``$XDG_CACHE_HOME/lapheads/native``), so an upgraded torch never loads a stale binary; it is moved in place
  atomically, so an interrupted build leaves nothing half-written.
* **One flag.** ``LAPHEADS_NATIVE=0`` (or ``set_enabled(False)``) keeps the op on the Python node, e.g. for a parity
  check; a library that exists but fails to load is warned about once and not used.
* **Trusted only when it is ours.** Loading a library runs its code, so a library is loaded only from a folder and
  file owned by this user and writable by nobody else, and only when its size and sha256 match the record ``kernel
  build`` wrote beside it (``lapheads_native.so.sha256``). Checked before ``dlopen``: a library cut short or swapped
  is one line and the Python node, never a signal or a stranger's code. ``kernel build`` rebuilds what it cannot
  trust; ``status`` never loads a disabled node.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

import torch

from lapheads.errors import InputError

__all__ = ["available", "build", "disabled", "enabled", "library_path", "module", "set_enabled", "status"]

_NAME = "lapheads_native"
_SOURCE = Path(__file__).with_name("csrc") / "laplacian_sdpa.cpp"
_enabled = os.environ.get("LAPHEADS_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _cache_root() -> Path:
    if os.environ.get("LAPHEADS_NATIVE_DIR"):
        return Path(os.environ["LAPHEADS_NATIVE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "lapheads" / "native"


def library_path() -> Path:
    """Where this source, built against this torch and Python, lives (whether built or not)."""
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    torch_build = (torch.version.git_version or "unknown")[:10]
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    tag = f"{digest}-torch{torch.__version__}-{torch_build}-{python}-{platform.machine()}"
    return _cache_root() / tag / f"{_NAME}{'.pyd' if sys.platform == 'win32' else '.so'}"  # as cpp_extension names it


def enabled() -> bool:
    """Whether the op may use the compiled node (``LAPHEADS_NATIVE``, ``set_enabled``)."""
    return _enabled


def set_enabled(value: bool) -> None:
    """Let the op use the compiled node (True, the default where it is built) or keep it on the Python node."""
    global _enabled
    _enabled = bool(value)


@contextlib.contextmanager
def disabled():
    """Within this block the op uses the Python node (a parity check, a profile of the Python path)."""
    before = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(before)


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _untrusted(path: Path) -> str | None:
    """Why the library at ``path`` must not be loaded (None: it is ours, whole, and as built)."""
    for item in (path.parent, path, _record_path(path)):
        if not item.exists() and not item.is_symlink():
            return f"{item} is missing (lapheads kernel build writes it)"
        why = _unsafe(item)
        if why is not None:
            return f"{item} {why}"
    try:
        expected_size, expected_hash = _record_path(path).read_text().split()
    except (OSError, ValueError, UnicodeDecodeError):
        return f"{_record_path(path)} is not a build record"
    size = path.stat().st_size
    if str(size) != expected_size:
        return f"{path} has {size} bytes, {expected_size} when built (cut short or replaced)"
    if hashlib.sha256(path.read_bytes()).hexdigest() != expected_hash:
        return f"{path}'s sha256 differs from the one recorded when it was built"
    return None


@functools.cache
def _load() -> ModuleType | None:
    path = library_path()
    if not path.is_file():
        return None
    why = _untrusted(path)
    if why is not None:
        warnings.warn(
            f"lapheads: not loading the compiled CPU node: {why}; using the Python node (lapheads kernel build "
            "rebuilds it)",
            stacklevel=3,
        )
        return None
    try:
        spec = importlib.util.spec_from_file_location(_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError) as err:
        warnings.warn(
            f"lapheads: the compiled CPU node at {path} does not load ({err}); using the Python node "
            "(rebuild: lapheads kernel build --force)",
            stacklevel=3,
        )
        return None


def module() -> ModuleType | None:
    """The compiled node's module where it is enabled and built, else None (the op then uses the Python node)."""
    return _load() if _enabled else None


def available() -> bool:
    """Whether the compiled node is built for this torch and Python and loads."""
    return _load() is not None


def status() -> str:
    """One line: whether the op uses the compiled CPU node, and why not where it does not."""
    path = library_path()
    if not path.is_file():
        return f"not built (lapheads kernel build; it would live at {path}); the op uses the Python node"
    if not _enabled:  # never load what is disabled
        return f"built at {path}, disabled (LAPHEADS_NATIVE=0); the op uses the Python node"
    why = _untrusted(path)
    if why is not None:
        return f"not trusted ({why}); the op uses the Python node (lapheads kernel build rebuilds it)"
    if not available():
        return f"built at {path} but does not load; the op uses the Python node (lapheads kernel build --force)"
    if not _enabled:
        return f"built at {path}, disabled (LAPHEADS_NATIVE=0); the op uses the Python node"
    return f"built at {path}; the op uses it on the CPU"


def _path_with_ninja() -> str:
    """PATH with pip's ninja binary (``pip install ninja``) ahead, where that package is installed."""
    path = os.environ.get("PATH", "")
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return path
    return os.pathsep.join([ninja.BIN_DIR, path])


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compile the node for this torch and Python into the cache (about 30 s) and return the library's path.

    Raises:
        InputError: no C++ compiler or no ninja on this machine, or the compiler failed (its first error named).
    """
    path = library_path()
    if path.is_file() and not force and _untrusted(path) is None:
        return path
    cpp_extension = _quiet_import_cpp_extension()
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise InputError(f"no C++ compiler {compiler!r} on PATH; allowed: install one (e.g. apt-get install g++)")
    search_path = _path_with_ninja()
    if shutil.which("ninja", path=search_path) is None:
        raise InputError("ninja not found; allowed: pip install ninja (or your system's ninja package)")
    if (path.parent.exists() or path.parent.is_symlink()) and _unsafe(path.parent) is not None:
        # a folder we cannot trust: build beside it and move it aside, never into it
        aside = path.parent.with_name(f"{path.parent.name}.untrusted-{os.getpid()}")
        os.replace(path.parent, aside)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    os.chmod(path.parent, 0o755)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as work:
        saved_path = os.environ.get("PATH", "")
        os.environ["PATH"] = search_path  # cpp_extension finds ninja on this process's PATH
        try:
            cpp_extension.load(
                name=_NAME,
                sources=[str(_SOURCE)],
                extra_cflags=["-O2"],
                build_directory=work,
                verbose=verbose,
            )
        except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
            lines = [line for line in str(err).splitlines() if "error" in line.lower()] or [str(err)]
            raise InputError(f"building the compiled CPU node failed: {lines[0].strip()}") from err
        finally:
            os.environ["PATH"] = saved_path
        built = Path(work) / path.name
        os.chmod(built, 0o755)
        record = Path(work) / _record_path(path).name
        record.write_text(f"{built.stat().st_size} {hashlib.sha256(built.read_bytes()).hexdigest()}\n")
        os.chmod(record, 0o644)
        _record_path(path).unlink(missing_ok=True)  # no moment where an old record vouches for the new library
        os.replace(built, path)  # atomic: a reader sees the whole library or none
        os.replace(record, _record_path(path))
    _load.cache_clear()
    return path


def _unsafe(item: Path) -> str | None:
    """Why ``item`` is not this user's alone (a link, another owner, writable by others), None when it is."""
    info = item.lstat()
    if item.is_symlink():
        return "is a symbolic link"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"belongs to user id {info.st_uid}, not to this user ({os.getuid()})"
    if info.st_mode & 0o022:
        return f"is writable by others (mode {oct(info.st_mode & 0o777)})"
    return None


def _quiet_import_cpp_extension() -> ModuleType:
    """torch.utils.cpp_extension, without its import-time warning about CUDA on a machine without it."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension
