"""Side-by-side timing and peak-memory measurement, shared by ``benchmarks/`` and ``lapheads demo``.

Speed claims in this project are ratios measured in one process, one run: every round calls each candidate once in
a fresh random order, and we report medians, so slow drifts of the machine (thermal, another process) hit all
candidates alike. ``interleaved_ratios`` goes one step further for small differences: it divides the candidates'
times round by round and states the median of those ratios with a distribution-free 95% interval, so a bar like
"<= 1.01x" is met only when the interval says so.
"""

from __future__ import annotations

import ctypes
import gc
import math
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

__all__ = [
    "cpu_description",
    "replace_section",
    "interleaved_ratios",
    "machine_summary",
    "median_interval",
    "peak_memory_mib",
    "time_interleaved",
]


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
    samples = _interleaved_samples(candidates, repeats, warmup, torch.device(device), seed)
    return {name: statistics.median(values) for name, values in samples.items()}


def _interleaved_samples(
    candidates: dict[str, Callable[[], object]], repeats: int, warmup: int, device: torch.device, seed: int
) -> dict[str, list[float]]:
    """Wall seconds of every timed round, per candidate (round r of each list is the same round)."""
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
    return samples


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the sample median and a distribution-free interval for the population median from order
    statistics ([x_(j), x_(n-j+1)] with the largest j whose binomial coverage is >= ``confidence``); low and high
    are NaN below 6 values, where no such interval exists at 95%."""
    from scipy.stats import binom

    xs, n = sorted(values), len(values)
    median = statistics.median(xs) if xs else math.nan
    j = int(binom.ppf((1 - confidence) / 2, n, 0.5)) if n else 0  # P(Bin(n, 1/2) <= j - 1) <= (1 - confidence) / 2
    if j >= 1 and binom.cdf(j - 1, n, 0.5) > (1 - confidence) / 2:
        j -= 1
    if j < 1:
        return float(median), math.nan, math.nan
    return float(median), float(xs[j - 1]), float(xs[n - j])


def interleaved_ratios(
    candidates: dict[str, Callable[[], object]],
    baseline: str,
    repeats: int,
    *,
    warmup: int = 2,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Each candidate's median seconds and its time relative to ``baseline`` paired round by round.

    Returns per candidate ``seconds`` (median), ``ratio`` (median over rounds of its time / the baseline's time in
    the same round) and ``ratio_low`` / ``ratio_high`` (the distribution-free 95% interval of that median,
    :func:`median_interval`). A round's two calls run back to back, so a slow phase of the machine divides out.

    Args:
        candidates: name -> zero-argument callable doing one unit of work; ``baseline`` must be one of them.
        repeats: timed rounds (>= 6 for an interval; 20 or more for a tight one).
    """
    samples = _interleaved_samples(candidates, repeats, warmup, torch.device(device), seed)
    out = {}
    for name, times in samples.items():
        ratio, low, high = median_interval([t / b for t, b in zip(times, samples[baseline])])
        out[name] = {"seconds": statistics.median(times), "ratio": ratio, "ratio_low": low, "ratio_high": high}
    return out


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


def cpu_description() -> str:
    """The CPU's model name, its CPU count and the flags that decide precision defaults (for benchmark tables)."""
    from pathlib import Path

    from lapheads.hardware import cpu_flags

    name = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            break
    have = cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    flags = ", ".join(f"{f} {'yes' if f in have else 'no'}" for f in wanted)
    import os

    return f"{name}, {os.cpu_count()} CPUs; flags: {flags}"


def replace_section(path, text: str) -> None:
    """Put ``text`` (first line: a begin marker, last line: an end marker) in place of that section of the
    Markdown file ``path``, or append it."""
    from pathlib import Path

    path = Path(path)
    old = path.read_text() if path.exists() else ""
    begin, end = text.splitlines()[0], text.splitlines()[-1]
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + text + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(new)


def write_section(script: str, lines: list[str], write: str | None) -> str:
    """A benchmark's Markdown section: ``lines`` between the markers of ``script`` ("<!-- windows.py: begin -->"),
    put in place of that section of the file ``write`` names (when it names one), and returned (the script prints
    it)."""
    text = "\n".join([f"<!-- {script}: begin -->", *lines, f"<!-- {script}: end -->"])
    if write:
        replace_section(write, text)
    return text
