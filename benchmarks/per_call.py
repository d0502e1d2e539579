"""Benchmark: the op's and the module's per-call cost at the smallest shape, across source trees.

A refactor of how heads are parsed, checked or planned changes nothing a big shape can see (the attention itself
dominates) and everything a small one can: at B = 1, H = 4, T = 8 a call is ~20 us, most of it Python. This
benchmark times that path for each source tree given (e.g. the commit before a change, from a git worktree, and the
working tree), each in its own fresh process, the trees alternated round by round so drift hits all alike:

* ``op, k``: ``lapheads.laplacian_attention(q, k, v, laplacian_heads=2)`` (the trailing 2 of 4 heads);
* ``op, bools``: the same heads as a list of bools (the scattered-mask path's checks);
* ``module``: a ``lapheads.LaplacianAttention(dim=32, num_heads=4, laplacian_heads=2)`` forward.

Inference (``torch.no_grad``), one thread, fp32; a measurement is the best of 9 repeats of 2,000 calls, in us per
call; the table gives each tree's median and range over the rounds.

    git worktree add /tmp/before HEAD~1
    python benchmarks/per_call.py /tmp/before/src src --rounds 5     # ~1 minute; nothing else may run meanwhile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

FORMS = ("op, k", "op, bools", "module")
CALLS, REPEATS = 2_000, 9


def measure() -> dict[str, float]:
    """Best-of-REPEATS microseconds per call of each form, in this process (its lapheads from PYTHONPATH)."""
    import timeit

    import torch

    import lapheads

    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 8) for _ in range(3))
    module = lapheads.LaplacianAttention(dim=32, num_heads=4, laplacian_heads=2).eval()
    x = torch.randn(1, 8, 32)
    calls = {
        "op, k": lambda: lapheads.laplacian_attention(q, k, v, laplacian_heads=2),
        "op, bools": lambda: lapheads.laplacian_attention(q, k, v, laplacian_heads=[False, False, True, True]),
        "module": lambda: module(x),
    }
    out = {}
    with torch.no_grad():
        for name, call in calls.items():
            call()  # first call: lazy imports and caches
            out[name] = min(timeit.repeat(call, number=CALLS, repeat=REPEATS)) / CALLS * 1e6
    return out


def run_tree(tree: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--measure"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"per_call.py: {tree} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", help="source folders holding lapheads/ (default: this checkout's src)")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the trees")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    trees = args.trees or [str(Path(__file__).resolve().parents[1] / "src")]
    for tree in trees:
        if not (Path(tree) / "lapheads" / "__init__.py").is_file():
            raise SystemExit(f"per_call.py: {tree} holds no lapheads/__init__.py; allowed: a source folder (src)")
    if args.rounds < 1:
        raise SystemExit(f"per_call.py: --rounds {args.rounds}; allowed: 1 or more")
    results: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    for round_ in range(args.rounds):
        for tree in trees if round_ % 2 == 0 else trees[::-1]:
            results[tree].append(run_tree(tree))
    print(f"us per call (B = 1, H = 4, T = 8, 2 of 4 heads Laplacian, no_grad, 1 thread), {args.rounds} rounds:")
    print("| tree | " + " | ".join(FORMS) + " |")
    print("|---|" + "---:|" * len(FORMS))
    for tree, rounds in results.items():
        cells = []
        for form in FORMS:
            values = [r[form] for r in rounds]
            cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]")
        print(f"| {tree} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
