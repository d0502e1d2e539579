"""Benchmark: an image run's batches read and augmented by the trainer itself vs ahead in worker processes.

What it loads: DeiT-III's training transform (``deit3-base-imagenet``: random-resized crops to 192 px, 3-Augment,
colour jitter 0.3, flips) on an ImageFolder of generated JPEGs of ImageNet's typical size (500 x 375), read by
``lapheads.train.runtime.step_loader`` exactly as ``lapheads train classify`` reads them (``--num-workers``).

What it times, per worker count (0: the trainer reads each micro-batch itself; N: N processes read ahead):

* **loading alone**: images per second through the loader, nothing else running;
* **a GPU run's step**: the loop with a stand-in for the model's step on a GPU, ``--gpu-ms`` of wall time during
  which the CPU is free (a sleep; what a GPU step leaves the CPU): with 0 workers a step costs loading plus the
  model's time, with workers the two overlap.

Worker counts run in interleaved rounds (shuffled per round), each a fresh loader; reported: the median over
rounds and each count's ratio to 0 workers with a 95 % interval (``lapheads.bench.median_interval``). The batches
themselves do not depend on the worker count (tests/train/test_batches.py), so only time is compared here.

    python benchmarks/loading.py                       # ~3 minutes on 2 cores; nothing else may run meanwhile
    python benchmarks/loading.py --write docs/benchmarks.md
    python benchmarks/loading.py --smoke               # tiny sizes: that it runs
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import tempfile
import time
from pathlib import Path


def make_imagefolder(root: Path, images: int, size: tuple[int, int]) -> None:
    """``root``/train and /val with 10 classes of generated JPEGs (smooth noise, so they compress as photos do)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", images), ("val", 10)):
        for i in range(count):
            folder = root / split / f"class{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            coarse = rng.integers(0, 256, (size[1] // 25 + 1, size[0] // 25 + 1, 3), dtype=np.uint8)
            image = Image.fromarray(coarse).resize(size, Image.BICUBIC)
            image.save(folder / f"{i}.jpg", quality=90)


def seconds_per_step(train, workers: int, micro_batch: int, steps: int, gpu_s: float) -> float:
    """Median wall seconds per step over ``steps`` steps (after one untimed), ``gpu_s`` of model time each."""
    from lapheads.train.classify import collate_images
    from lapheads.train.runtime import GlobalBatchSampler, step_loader

    sampler = GlobalBatchSampler(len(train), micro_batch, 1, 0, 1, seed=0)
    stream = step_loader(train, sampler, 0, collate_images, num_workers=workers)
    times = []
    for _ in itertools.islice(stream, 1):  # workers start and fill their queues
        pass
    start = time.perf_counter()
    for _ in itertools.islice(stream, steps):
        time.sleep(gpu_s)  # the model's step on a GPU: the CPU is free meanwhile
        now = time.perf_counter()
        times.append(now - start)
        start = now
    del stream  # its workers stop
    return statistics.median(times)


def _ratio(values: list[float], baseline: list[float]) -> str:
    from lapheads.bench import median_interval

    ratio, low, high = median_interval([v / b for v, b in zip(values, baseline)])
    return f"{ratio:.2f}x" + ("" if low != low else f" [{low:.2f}, {high:.2f}]")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default=None, help="comma list of worker counts (default: 0, 1, the CPUs)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per measurement")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--gpu-ms", type=float, default=150.0, help="the stand-in model step's wall time")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: that it runs")
    parser.add_argument("--write", default=None, help="replace this script's section of a Markdown file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.micro_batch, args.gpu_ms = 1, 2, 4, 1.0
    cpus = len(os.sched_getaffinity(0))
    workers = [int(w) for w in args.workers.split(",")] if args.workers else sorted({0, 1, cpus})
    from lapheads.data.images import build_image_data

    results = {(w, gpu): [] for w in workers for gpu in (False, True)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_imagefolder(root, args.micro_batch * (args.steps + 2) * 2, (500, 375))
        train = build_image_data("imagefolder", str(root), 192, three_augment=True, color_jitter=0.3).train
        rng = random.Random(0)
        for round_ in range(args.rounds):
            order = [(w, gpu) for w in workers for gpu in (False, True)]
            rng.shuffle(order)
            for w, gpu in order:
                seconds = seconds_per_step(train, w, args.micro_batch, args.steps, args.gpu_ms / 1000 if gpu else 0)
                results[(w, gpu)].append(seconds)
                print(f"round {round_ + 1} workers {w} {'gpu step' if gpu else 'loading'}: {seconds:.3f} s", flush=True)
    from lapheads.bench import cpu_description, write_section

    lines = [
        f"`python benchmarks/loading.py --rounds {args.rounds}`: DeiT-III's training transform on generated 500 x 375 "
        f"JPEGs, micro-batch {args.micro_batch}, through `step_loader` as `lapheads train classify --num-workers N` "
        f"reads; median seconds per step of {args.steps}, {args.rounds} interleaved rounds; 'a GPU run's step' adds "
        f"a {args.gpu_ms:.0f} ms stand-in for the model's step during which the CPU is free. CPU: {cpu_description()}.",
        "",
        "| workers | loading alone: s/step | images/s | time vs 0 workers | with the GPU step: s/step | "
        "time vs 0 workers |",
        "|---|---|---|---|---|---|",
    ]
    for w in workers:
        alone, gpu = results[(w, False)], results[(w, True)]
        lines.append(
            f"| {w} | {statistics.median(alone):.3f} | {args.micro_batch / statistics.median(alone):.0f} | "
            f"{_ratio(alone, results[(0, False)]) if 0 in workers else '-'} | {statistics.median(gpu):.3f} | "
            f"{_ratio(gpu, results[(0, True)]) if 0 in workers else '-'} |"
        )
    text = write_section("loading.py", lines, args.write)
    print(text)
    return text


if __name__ == "__main__":
    main()
