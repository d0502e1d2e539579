"""Benchmark: CPU threads and OpenMP's wait policy for a training step, on an idle and on a busy machine.

One ViT training step of the demo's recipe (fmnist-cpu: 6 layers, 192 dim, 3 heads, patch 7 on 28 px, batch 128,
forward + backward + AdamW, fp32) in a fresh process per measurement (OpenMP reads its settings once, when torch
loads it), for each thread setting:

* ``lapheads auto``: what every ``lapheads`` command does (``lapheads.hardware``: the free CPUs, a passive wait
  policy only when others are busy and more than one thread is left);
* ``2 threads, spin``: OpenMP's default (``OMP_NUM_THREADS=2``);
* ``2 threads, passive``: ``OMP_WAIT_POLICY=PASSIVE``;
* ``1 thread``.

Each setting runs idle and beside one competing busy-loop process that this script starts and stops itself, in
interleaved rounds (settings shuffled per round). Reported: the median step time per setting and condition, and
ratios with a 95 % interval (t on the log ratios of the rounds' medians): busy / idle per setting, and each setting
against OpenMP's default in the same condition.

    python benchmarks/threads.py                       # ~5 minutes on 2 cores; nothing else may run meanwhile
    python benchmarks/threads.py --rounds 6 --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys

SETTINGS = {
    "lapheads auto": {},
    "2 threads, spin": {"OMP_NUM_THREADS": "2"},
    "2 threads, passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}


def child(steps: int, batch: int) -> None:
    """One measurement: choose threads as the lapheads command does (unless OMP_NUM_THREADS is set), then time."""
    from lapheads.hardware import apply_thread_policy

    policy = apply_thread_policy("auto", announce=False)
    import time

    import torch

    from lapheads.models.vit import create_vit

    torch.manual_seed(0)
    model = create_vit("vit_fmnist_patch4", 0, patch_size=7, img_size=28, in_chans=1, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, labels = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
    chosen = policy.threads if policy is not None else torch.get_num_threads()
    print(json.dumps({"median": statistics.median(times), "threads": chosen}))


def _measure(setting: str, steps: int, batch: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    env.update(SETTINGS[setting])
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--steps", str(steps), "--batch", str(batch)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ratio(numerators: list[float], denominators: list[float]) -> str:
    """Geometric mean of paired ratios with a t-based 95 % interval."""
    from scipy import stats

    logs = [math.log(a / b) for a, b in zip(numerators, denominators)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return f"{math.exp(mean):.2f}x"
    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return f"{math.exp(mean):.2f}x [{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}]"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement (after 2 warm-up steps)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--write", default=None, help="replace this script's section of a Markdown file")
    args = parser.parse_args(argv)
    if args.child:
        child(args.steps, args.batch)
        return ""
    rng = random.Random(0)
    results = {(s, c): [] for s in SETTINGS for c in ("idle", "busy")}
    threads = {}
    for round_ in range(args.rounds):
        for condition in ("idle", "busy"):
            load = None
            if condition == "busy":  # one CPU-bound neighbour, started and stopped here
                load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                order = list(SETTINGS)
                rng.shuffle(order)
                for setting in order:
                    measured = _measure(setting, args.steps, args.batch)
                    results[(setting, condition)].append(measured["median"])
                    threads[(setting, condition)] = measured["threads"]
                    print(f"round {round_ + 1} {condition:4s} {setting:20s} {measured['median']:.3f} s", flush=True)
            finally:
                if load is not None:
                    load.kill()
                    load.wait()
    from lapheads.bench import cpu_description, write_section

    lines = [
        f"`python benchmarks/threads.py --rounds {args.rounds}`: one fmnist-cpu ViT training step (batch "
        f"{args.batch}, fp32), median of {args.steps} steps per fresh process, {args.rounds} interleaved rounds; busy "
        f"= one competing busy-loop process. CPU: {cpu_description()}.",
        "",
        "| setting | threads idle / busy | idle s/step | busy s/step | busy / idle [95% CI] | idle vs spin | "
        "busy vs spin |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        idle, busy = results[(s, "idle")], results[(s, "busy")]
        spin_idle, spin_busy = results[("2 threads, spin", "idle")], results[("2 threads, spin", "busy")]
        lines.append(
            f"| {s} | {threads[(s, 'idle')]} / {threads[(s, 'busy')]} | {statistics.median(idle):.3f} | "
            f"{statistics.median(busy):.3f} | {_ratio(busy, idle)} | {_ratio(idle, spin_idle)} | "
            f"{_ratio(busy, spin_busy)} |"
        )
    return write_section("threads.py", lines, args.write)


if __name__ == "__main__":
    print(main())
