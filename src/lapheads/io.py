"""Reading files that may come from anywhere, without ever running code from them.

* Tensors: safetensors, or a PyTorch file through ``torch.load(weights_only=True)`` (tensors, containers and
  primitive types only); a pickle that carries code is refused before anything of it runs.
* Python pickles of *data* (CIFAR's batches): :func:`restricted_unpickle` admits only the classes a format needs
  (here: numpy arrays and their dtypes, plus builtin containers, bytes and strings), so a ``__reduce__`` payload
  fails on its first global lookup instead of running.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from lapheads.errors import CheckpointError, InputError

__all__ = [
    "NUMPY_ARRAY_GLOBALS",
    "atomic_write_text",
    "exclusive",
    "json_depth",
    "json_loads",
    "MAX_JSON_DEPTH",
    "sole_owner",
    "load_safetensors",
    "load_tensor_file",
    "MAX_STUDY_FILE_BYTES",
    "read_regular_bytes",
    "read_regular_text",
    "restricted_unpickle",
    "state_dict_mismatch",
]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


#: the most a record, plan, report or stats.json that lapheads reads may hold: its own are under 2 MB
MAX_STUDY_FILE_BYTES = 64 * 1024 * 1024


def read_regular_bytes(path: str | Path, limit: int = MAX_STUDY_FILE_BYTES) -> bytes:
    """A regular file's bytes, or an OSError that says why not, so each caller's one-line "cannot be read" covers it:
    a FIFO (reading it blocks until a writer comes), a device such as /dev/zero (it never ends), a folder, also
    behind a link; and a file of more than ``limit`` bytes (read no further than that)."""
    import stat

    status = os.stat(path)  # follows links: a link to /dev/zero is a device
    if not stat.S_ISREG(status.st_mode):
        raise OSError(f"{path} is not a regular file; allowed: a regular file (not a FIFO, device or folder)")
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} holds more than {limit:,} bytes; allowed: at most {limit:,}")
    return data


def read_regular_text(path: str | Path, limit: int = MAX_STUDY_FILE_BYTES) -> str:
    """:func:`read_regular_bytes` decoded as UTF-8 (a UnicodeDecodeError for other bytes, as ``read_text`` gives)."""
    return read_regular_bytes(path, limit).decode()


#: the deepest JSON nesting lapheads reads from a file or an argument: its own files nest under 10 levels; Python's
#: json recurses once a level and fails at the interpreter's recursion limit (~1,000) with a RecursionError
MAX_JSON_DEPTH = 128
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes | str) -> int:
    """The deepest bracket nesting of a JSON text, counted before it is parsed (strings removed, then one scan of
    the brackets): nothing recursive, so any depth is counted in time linear in the text."""
    data = raw.encode() if isinstance(raw, str) else raw
    depth = deepest = 0
    for byte in _JSON_STRING.sub(b'""', data).translate(None, _NOT_A_BRACKET):
        if byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def json_loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` that refuses nesting deeper than ``max_depth`` the way it refuses any malformed text: with a
    ``json.JSONDecodeError`` (a ValueError), so every caller's one-line error for a bad file covers it too."""
    depth = json_depth(text)
    if depth > max_depth:
        document = text if isinstance(text, str) else text.decode(errors="replace")
        raise json.JSONDecodeError(f"nested {depth} levels deep; allowed: at most {max_depth}", document[:80], 0)
    return json.loads(text)


#: What numpy arrays pickle as, in numpy 1.x and 2.x (``_frombuffer`` with protocol 5; ``_codecs.encode`` carries
#: bytes in protocol-2 pickles). Each only builds arrays, dtypes or bytes from data.
NUMPY_ARRAY_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }
)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(
        self,
        file: IO[bytes],
        allowed: frozenset[tuple[str, str]],
        replacements: dict[tuple[str, str], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(file, **kwargs)
        self.allowed, self.replacements = allowed, replacements or {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"refused to load {module}.{name} (not a data type of this format)")
        if (module, name) in self.replacements:  # a stricter stand-in for an admitted class
            return self.replacements[(module, name)]
        return super().find_class(module, name)


def restricted_unpickle(
    file: IO[bytes],
    allowed: frozenset[tuple[str, str]] = NUMPY_ARRAY_GLOBALS,
    encoding: str = "latin1",
    replacements: dict[tuple[str, str], Any] | None = None,
) -> Any:
    """Unpickle ``file`` admitting only the ``(module, name)`` globals in ``allowed`` (``replacements`` maps some of
    them to stricter stand-ins, e.g. a class whose ``__setstate__`` accepts data only).

    Raises:
        pickle.UnpicklingError: on any other global (e.g. ``os.system`` in a ``__reduce__`` payload).
    """
    return _RestrictedUnpickler(file, allowed, replacements, encoding=encoding).load()


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file; anything else (a pickle with code in it, a truncated file) is refused in one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; allowed: a .safetensors file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{path} is not a valid safetensors file ({str(err).splitlines()[0][:100]}); refusing "
            "to load it (lapheads never unpickles checkpoints)"
        ) from None


def state_dict_mismatch(expected: dict[str, torch.Tensor], tensors: dict[str, Any]) -> str | None:
    """What keeps ``tensors`` from loading strictly into a module whose state dict is ``expected``, or None."""
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    shapes = sorted(k for k in set(expected) & set(tensors) if expected[k].shape != tensors[k].shape)
    if missing:
        return f"missing {missing[:3]}"
    if unexpected:
        return f"unexpected {unexpected[:3]}"
    if shapes:
        return (
            f"shape of {shapes[0]}: file {tuple(tensors[shapes[0]].shape)} vs model {tuple(expected[shapes[0]].shape)}"
        )
    # a weight stored as int8 or bool would be cast silently by load_state_dict: not what the run trained
    kinds = sorted(k for k in expected if expected[k].dtype.is_floating_point != tensors[k].dtype.is_floating_point)
    if kinds:
        return f"dtype of {kinds[0]}: file {tensors[kinds[0]].dtype} vs model {expected[kinds[0]].dtype}"
    bad = next(
        (k for k, v in tensors.items() if v.dtype.is_floating_point and v.numel() and not bool(v.isfinite().all())),
        None,
    )
    if bad is not None:
        return f"{bad} holds NaN or inf values"
    # finite in the file, inf in the model: a float64 1e300 read into float32 (load_state_dict casts silently)
    narrowed = next((k for k, v in tensors.items() if _overflows(v, expected[k].dtype)), None)
    if narrowed is not None:
        return (
            f"{narrowed} holds values beyond {expected[narrowed].dtype}'s range (largest "
            f"{float(tensors[narrowed].abs().max()):.3g}); allowed: values that stay finite in the model's dtype"
        )
    return None


def _overflows(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether finite floating ``values`` become inf when cast to ``dtype`` (a narrower float)."""
    if not (values.dtype.is_floating_point and dtype.is_floating_point) or not values.numel():
        return False
    if torch.finfo(values.dtype).max <= torch.finfo(dtype).max:
        return False
    return not bool(values.to(dtype).isfinite().all())


def load_tensor_file(path: str | Path) -> dict[str, Any]:
    """A state dict from a ``.safetensors`` file or a PyTorch file, never executing code from it.

    Raises:
        CheckpointError: the file is missing, not a tensor file, or a pickle that needs more than tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist or is not a file; allowed: a .safetensors or .pth file")
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{path} is not a plain tensor file ({str(err).splitlines()[0][:100]}); refusing to "
            "load it (lapheads never runs code from a file)"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}; allowed: a state dict")
    return state


@contextlib.contextmanager
def exclusive(lock_file: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if needed) for the block: processes that prepare the same
    data at the same time (sweep cells, torchrun ranks) take turns, and the later ones find it ready (filelock: an
    OS lock, released when the process ends however it ends)."""
    from filelock import FileLock

    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_file)):
        yield


@contextlib.contextmanager
def sole_owner(lock_file: str | Path, what: str) -> Iterator[None]:
    """Hold ``lock_file`` for the block or refuse at once, in one line naming the process that holds it: one
    process at a time may write ``what`` (a sweep folder). The holder's pid is kept beside the lock."""
    from filelock import FileLock, Timeout

    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    owner_file = lock_file.with_name(lock_file.name + ".pid")
    for path in (lock_file, owner_file):  # opening either truncates it: never through a link to someone's file
        if path.is_symlink():
            raise InputError(f"{path} is a symbolic link; lapheads keeps its lock files itself; allowed: remove it")
    lock = FileLock(str(lock_file))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            owner = owner_file.read_text().strip() or "unknown"
        except OSError:
            owner = "unknown"
        raise InputError(
            f"{what} is in use by process {owner} (another lapheads command writes it); allowed: wait for it to "
            "finish, or stop it first"
        ) from None
    try:
        with os.fdopen(os.open(owner_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "w") as f:
            f.write(f"{os.getpid()}\n")  # O_NOFOLLOW: a link made since the check above is refused, not followed
        yield
    finally:
        owner_file.unlink(missing_ok=True)
        lock.release()
