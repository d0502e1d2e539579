"""Red team, sandbox containment (issues 28 and 44): nothing of the caller's is written, deleted, read, signalled or
connected to. Escapes are "contained" (the caller's files, environment and processes untouched, the call back
within its deadline) by the boundary (bubblewrap) and, for the GUARDED rows, refused by the in-process guard alone;
BOUNDARY_ONLY rows are contained by the boundary only (the guard is not a boundary, as lapheads.sandbox says);
hangs, floods and bombs are bounded.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from lapheads import sandbox
from lapheads.sandbox import run_program
from tests.conftest import processes_with

#: hostile code undoing the guard's import block (its finder first on sys.meta_path, which the program may not name)
UNGUARD_CTYPES = "import sys\nvars(sys)['meta_path'].pop(0)\nimport ctypes\n"

#: writes, deletions, renames, links, folder changes and spawns outside the work folder: the guard alone refuses
#: each ("sandbox: ..."), and bubblewrap contains each
GUARDED = {
    "open w": "open({new!r}, 'w').write('x')",
    "open a on the victim": "open({victim!r}, 'a').write('x')",
    "open x": "open({new!r}, 'x')",
    "open r+ on the victim": "open({victim!r}, 'r+').write('x')",
    "pathlib write_text": "import pathlib; pathlib.Path({new!r}).write_text('x')",
    "pathlib touch": "import pathlib; pathlib.Path({new!r}).touch()",
    "io.FileIO": "import io; io.FileIO({new!r}, 'w').write(b'x')",
    "_io.open": "import _io; _io.open({new!r}, 'w').write('x')",
    "os.open O_CREAT": "import os; os.close(os.open({new!r}, os.O_CREAT | os.O_WRONLY))",
    "posix.open": "import posix; posix.close(posix.open({new!r}, 0o101))",
    "os.open with dir_fd": "import os; fd = os.open({outside!r}, os.O_RDONLY); "
    "os.open('w', os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
    "os.remove": "import os; os.remove({victim!r})",
    "os.unlink": "import os; os.unlink({victim!r})",
    "posix.unlink": "import posix; posix.unlink({victim!r})",
    "unlink with dir_fd": "import os; fd = os.open({outside!r}, os.O_RDONLY); os.unlink('victim', dir_fd=fd)",
    "reload(os) then unlink": "import importlib, os; importlib.reload(os); os.unlink({victim!r})",
    "os.rename the victim in": "import os; os.rename({victim!r}, 'mine')",
    "os.replace the victim": "import os; open('x', 'w').write('x'); os.replace('x', {victim!r})",
    "os.link": "import os; os.link({victim!r}, {new!r})",
    "os.symlink outside": "import os; os.symlink('/etc/hostname', {new!r})",
    "a link inside, written through": "import os; os.symlink({victim!r}, 'link'); open('link', 'w').write('x')",
    "os.mkdir outside": "import os; os.mkdir({new!r})",
    "os.makedirs outside": "import os; os.makedirs({new!r} + '/a/b')",
    "os.chmod the victim": "import os; os.chmod({victim!r}, 0o777)",
    "os.truncate the victim": "import os; os.truncate({victim!r}, 0)",
    "os.utime the victim": "import os; os.utime({victim!r}, (0, 0))",
    "os.mkfifo": "import os; os.mkfifo({new!r})",
    "os.chdir out": "import os; os.chdir({outside!r}); open('w', 'w').write('x')",
    "shutil.copy": "import shutil; shutil.copy('/etc/hostname', {new!r})",
    "shutil.copyfile": "import shutil; shutil.copyfile('/etc/hostname', {new!r})",
    "shutil.move the victim in": "import shutil; shutil.move({victim!r}, 'mine')",
    "shutil.rmtree": "import shutil; shutil.rmtree({outside!r})",
    "os.system": "import os; os.system('touch ' + {new!r})",
    "os.popen": "import os; os.popen('touch ' + {new!r}).read()",
    "subprocess.run": "import subprocess; subprocess.run(['touch', {new!r}])",
    "subprocess.Popen": "import subprocess; subprocess.Popen(['touch', {new!r}]).wait()",
    "os.fork": "import os; os.fork()",
    "os.execv": "import os; os.execv('/usr/bin/touch', ['touch', {new!r}])",
    "posix_spawn": "import posix; posix.posix_spawn('/bin/sh', ['sh', '-c', 'touch ' + {new!r}], {{}})",
    "os.kill the parent": "import os, signal; os.kill(os.getppid(), signal.SIGKILL)",
    "os.killpg": "import os, signal; os.killpg(0, signal.SIGKILL)",
    "pidfd_send_signal": "import os, signal; signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)",
    "os.setsid": "import os; os.setsid()",
    "ctypes": "import ctypes",
    # the guard's originals and the primitives it removes, reached the ways a red team found
    "open.__globals__'s original": "open.__globals__['_open']({new!r}, 'w').write('x')",
    "unlink's original from its closure": "import os; os.unlink.__closure__[-1].cell_contents({victim!r})",
    "a closure through getattr": "import os; getattr(os.unlink, '__clo' + 'sure__')[-1].cell_contents({victim!r})",
    "the caller's frame": "import sys; print(sys._getframe().f_back)",
    "an AF_UNIX bind writes a socket file": "import socket; socket.socket(socket.AF_UNIX).bind({new!r})",
    "readline's history file": "import readline; readline.write_history_file({new!r})",
    "_posixsubprocess re-imported": "import sys; sys.modules.pop('_posixsubprocess', None); import _posixsubprocess",
    "the collector's referents": "import gc",
    # issue 60: arguments by keyword, look-alike paths and modes, a second folder descriptor, the parent's limits
    "os.remove(path=)": "import os; os.remove(path={victim!r})",
    "os.unlink(path=)": "import os; os.unlink(path={victim!r})",
    "os.rename(src=, dst=)": "import os; os.rename(src={victim!r}, dst='mine')",
    "os.truncate(path=)": "import os; os.truncate(path={victim!r}, length=0)",
    "os.open(path=, flags=)": "import os; os.close(os.open(path={new!r}, flags=os.O_CREAT | os.O_WRONLY))",
    "shutil.rmtree(path=)": "import shutil; shutil.rmtree(path={outside!r})",
    "a str subclass that prints inside": "import os\nclass S(str):\n    def __str__(self):\n        return 'inside'\n"
    "    def __fspath__(self):\n        return 'inside'\nos.remove(S({victim!r}))",
    "a mode whose __str__ reads 'r'": "class M(str):\n    def __str__(self):\n        return 'r'\n"
    "    def __contains__(self, c):\n        return False\nopen({victim!r}, M('w')).write('x')",
    "flags whose __and__ is 0": "import os\nclass F(int):\n    def __and__(self, other):\n        return 0\n"
    "os.close(os.open({new!r}, F(os.O_CREAT | os.O_WRONLY)))",
    "rename with src_dir_fd": "import os; fd = os.open({outside!r}, os.O_RDONLY); "
    "os.rename('victim', 'mine', src_dir_fd=fd)",
    "resource.prlimit on the parent": "import os, resource; resource.prlimit(os.getppid(), resource.RLIMIT_CORE)",
    "_posixshmem": "import _posixshmem, os; fd = _posixshmem.shm_open('/' + {name!r}, os.O_CREAT | os.O_RDWR, 0o600)",
}

#: reaches only bubblewrap stops (code that undoes the guard, reads, the network): contained with the boundary
BOUNDARY_ONLY = {
    "sqlite3 creates a file": "import sqlite3; sqlite3.connect({new!r}).execute('create table t(x)')",
    "ctypes unlink": UNGUARD_CTYPES + "ctypes.CDLL(None).unlink({victim!r}.encode())",
    "ctypes open": UNGUARD_CTYPES + "ctypes.CDLL(None).open({new!r}.encode(), 0o101, 0o644)",
    "ctypes kill every process": UNGUARD_CTYPES + "ctypes.CDLL(None).kill(-1, 9)",
    "ctypes fork and touch": UNGUARD_CTYPES + "libc = ctypes.CDLL(None)\nif libc.fork() == 0:\n"
    "    libc.execl(b'/usr/bin/touch', b'touch', {new!r}.encode(), None)\nimport time; time.sleep(1)",
    "ctypes double fork, a daemon": UNGUARD_CTYPES + "daemon = 1\nlibc = ctypes.CDLL(None)\nif libc.fork() == 0:\n"
    "    libc.setsid()\n    if libc.fork() == 0:\n        import time; time.sleep(3)\n"
    "        open({new!r}, 'w').write('x')\n    libc._exit(0)",
    # the guard is no boundary: the standard library's introspection still reaches its originals
    "inspect reaches unlink's original": "import inspect, os\n"
    "inspect.getclosurevars(os.unlink).nonlocals['original']({victim!r})",
    "read the caller's file": "print(open({victim!r}).read())",
    "read the parent's environment": "import os; print(open(f'/proc/{{os.getppid()}}/environ', 'rb').read())",
    "read every environment": "import os\nfor p in os.listdir('/proc'):\n    try:\n"
    "        print(open(f'/proc/{{p}}/environ', 'rb').read())\n    except OSError:\n        pass",
    "read own environment": "import os; print(dict(os.environ))",
    "list the caller's folder": "import os; print(os.listdir({outside!r}))",
    "tcp to the caller": "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); "
    "print('LEAK' + 'ED')",
    "tcp to the internet": "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2); print('LEAK' + 'ED')",
    "udp out": "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "s.sendto(b'x', ('127.0.0.1', {port}))",  # reaches the namespace's own loopback, never the caller's
    "dns": "import socket; socket.getaddrinfo('pypi.org', 443); print('LEAK' + 'ED')",
    "write /dev/shm": "open('/dev/shm/' + {name!r}, 'w').write('x')",
    "write HOME": "import os; open(os.path.expanduser('~/' + {name!r}), 'w').write('x')",
    "write the caller's /tmp": "open('/tmp/' + {name!r}, 'w').write('x')",
}


def _caller_state(outside: Path) -> dict[str, str]:
    return {p.name: (p.read_text() if p.is_file() else "<dir>") for p in sorted(outside.iterdir())}


def _run_escape(template: str, tmp_path: Path, monkeypatch) -> tuple[sandbox.ExecutionResult, bool, Path]:
    import socket

    monkeypatch.setenv("LAPHEADS_TEST_SECRET", "s3cr3t-value")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("caller's data")
    (outside / "sub").mkdir()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    datagrams = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    datagrams.bind(("127.0.0.1", listener.getsockname()[1]))
    datagrams.setblocking(False)
    name = f"lapheads-escape-{uuid.uuid4().hex}"
    program = template.format(
        victim=str(outside / "victim"),
        new=str(outside / "new"),
        outside=str(outside),
        port=listener.getsockname()[1],
        name=name,
    )
    before = _caller_state(outside)
    start = time.monotonic()
    result = run_program(program + "\n", timeout=5)
    assert time.monotonic() - start <= 5 + 2
    if "daemon" in template:
        time.sleep(3.5)  # past the moment a surviving daemon would write
    try:
        listener.accept()
        connected = True
    except BlockingIOError:
        connected = False
    try:
        connected = connected or bool(datagrams.recv(64))
    except BlockingIOError:
        pass
    listener.close()
    datagrams.close()
    assert _caller_state(outside) == before, (program, result)
    assert not connected, program
    assert (
        "s3cr3t-value" not in result.output and "caller's data" not in result.output and "LEAKED" not in result.output
    )
    for shared in (Path("/dev/shm") / name, Path("/tmp") / name, Path.home() / name):
        assert not shared.exists(), shared
    return result, connected, outside


@pytest.mark.parametrize("name", sorted(GUARDED) + sorted(BOUNDARY_ONLY))
def test_the_boundary_contains(name, tmp_path, monkeypatch):
    if sandbox.boundary_tool() is None:
        pytest.skip("bubblewrap is not usable here")
    _run_escape({**GUARDED, **BOUNDARY_ONLY}[name], tmp_path, monkeypatch)


@pytest.mark.parametrize("name", sorted(GUARDED))
def test_the_guard_alone_refuses(name, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "boundary_tool", lambda: None)
    result, _, _ = _run_escape(GUARDED[name], tmp_path, monkeypatch)
    assert result.status == "failed" and "sandbox:" in result.output, (name, result)


def test_the_guard_reads_a_path_once(tmp_path, monkeypatch):
    """A path whose ``__fspath__`` answers the check with a file inside and the call with the caller's file (issue
    60): the guard reads it once and passes on what it read, so the inside file goes and the caller's stays."""
    monkeypatch.setattr(sandbox, "boundary_tool", lambda: None)
    template = (
        "import os\nopen('inside', 'w').close()\nclass P:\n    calls = 0\n    def __fspath__(self):\n"
        "        P.calls += 1\n        return 'inside' if P.calls == 1 else {victim!r}\n"
        "os.remove(P())\nassert not os.path.exists('inside') and P.calls == 1\n"
    )
    result, _, outside = _run_escape(template, tmp_path, monkeypatch)
    assert result.status == "passed", result
    assert (outside / "victim").read_text() == "caller's data"


#: hangs, floods and bombs: each call returns within its deadline + 2 s with the status stated, the caller's memory
#: stays far below the flood, and no process of the run is left behind
BOUNDED = {
    "stdout flood": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "timeout"),
    "stderr flood": ("import sys\nwhile True:\n    sys.stderr.write('x' * 65536)\n", "timeout"),
    "one endless line": ("import sys\nsys.stdout.write('x' * (1 << 28))\n", "failed"),
    "memory bomb": ("blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 26))\n", "failed"),
    "a file past the size limit": ("open('big', 'wb').write(b'x' * (64 << 20))\n", "failed"),
    "busy loop": ("while True:\n    pass\n", "timeout"),
    "sleep": ("import time\ntime.sleep(600)\n", "timeout"),
    "a setsid child that sleeps": (
        UNGUARD_CTYPES + "libc = ctypes.CDLL(None)\nif libc.fork() == 0:\n    libc.setsid()\n"
        "    libc.execl(b'/bin/sleep', b'sleep', b'{marker}', None)\n",
        "passed",
    ),
    "a child holding the pipes": (
        UNGUARD_CTYPES + "libc = ctypes.CDLL(None)\nif libc.fork() == 0:\n"
        "    libc.execl(b'/bin/sleep', b'sleep', b'{marker}', None)\nimport time\ntime.sleep(60)\n",
        "timeout",
    ),
    "a thread that never ends": (
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()\n",
        "timeout",
    ),
    "a blocking read of stdin": ("import sys\nsys.stdin.buffer.read()\nraise SystemExit(1)\n", "failed"),
    "a signal handler that ignores SIGTERM": (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n",
        "timeout",
    ),
}


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_bounded(name, layers):
    import resource

    template, expect = BOUNDED[name]
    marker = f"77.{uuid.uuid4().int % 10**9}"  # a unique sleep argument to look for afterwards
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    result = run_program(template.replace("{marker}", marker), timeout=2, memory_mb=512, max_file_mb=16)
    assert time.monotonic() - start <= 2 + 2, name
    assert result.status == expect, (name, result)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KB
    time.sleep(0.2)
    assert processes_with(marker) == []
