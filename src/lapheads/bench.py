"""Side-by-side timing and peak-memory measurement, shared by ``benchmarks/`` and ``lapheads demo``.

Speed claims in this project are ratios measured in one process, one run: every round calls each candidate once in
a fresh random order, and we report medians, so slow drifts of the machine (thermal, another process) hit all
candidates alike.
"""

from __future__ import annotations

import ctypes
import gc
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["machine_summary", "peak_memory_mib", "time_interleaved"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    candidates: dict[str, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 2,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, float]:
    """Median wall seconds per call of each candidate, measured interleaved in shuffled order.

    Args:
        candidates: name -> zero-argument callable doing one unit of work (e.g. forward + backward).
        repeats: timed rounds; each round calls every candidate once.
        warmup: untimed rounds first (allocator, caches, lazy init).
        device: where the work runs; CUDA work is synchronised before each clock read.
        seed: seed of the shuffling, for a repeatable order.
    """
    device = torch.device(device)
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for round_ in range(warmup + repeats):
        order = list(candidates)
        rng.shuffle(order)
        for name in order:
            _sync(device)
            start = time.perf_counter()
            candidates[name]()
            _sync(device)
            if round_ >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def _release_free_memory() -> None:
    gc.collect()
    try:  # hand glibc's free heap back to the OS so the next peak starts from resident = live memory
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_memory_mib(fn: Callable[[], object], device: torch.device | str = "cpu") -> float | None:
    """Extra memory (MiB) at the peak of one call of ``fn``, above what was live before it.

    CUDA: the caching allocator's peak. CPU (Linux): the peak resident set, reset through /proc/self/clear_refs.
    Returns None where neither is available.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    try:
        _release_free_memory()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
        before = _proc_status_kib("VmRSS")
        fn()
        return (_proc_status_kib("VmHWM") - before) / 1024
    except (OSError, RuntimeError):
        return None


def machine_summary(device: torch.device | str = "cpu") -> str:
    """One line naming the machine, for benchmark tables."""
    device = torch.device(device)
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"{where}; torch {torch.__version__}; Python {platform.python_version()}"
