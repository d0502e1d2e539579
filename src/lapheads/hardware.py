"""What this machine can do, decided by looking at it: autocast precision and CPU threads.

Design choices:

* **Precision follows the hardware** (``amp = auto``, the default). On CUDA, bf16 autocast where the GPU supports
  bf16. On a CPU, bf16 autocast only where the CPU has native bf16 (AVX-512-BF16 or AMX, from ``/proc/cpuinfo``
  or torch's CPU capability) *and* a short measured probe (a few bf16 vs fp32 matmuls, ~0.1 s) finds it faster;
  elsewhere fp32. Without native bf16, autocast emulates bf16: on an AVX2 AMD EPYC a training step was 20.1x
  (the fmnist-cpu ViT) and 20.8x (the shakespeare-cpu GPT) slower than fp32 (``benchmarks/precision.py``). The
  choice and its reason are printed once and recorded in config.json; ``--resume`` keeps the recorded choice, so
  a run's trajectory does not change machine by machine.
* **Threads follow the free CPUs** (``lapheads`` commands only; ``import lapheads`` changes nothing): the CPUs this
  process may use (affinity mask, cgroup quota) minus those other processes keep busy, sampled over 0.2 s from
  ``/proc/stat`` at start. OpenMP's spinning barrier is what a busy machine punishes (a descheduled thread stalls
  every other one): on 2 cores beside one busy loop, 2 spinning threads took 1.30 s per fmnist-cpu ViT step and 1
  thread 0.70 s. An idle machine keeps the default wait policy (passive waiting cost 1.27x [1.11, 1.46] there); a
  busy one that still gets more than one thread waits passively (``benchmarks/threads.py``, docs/benchmarks.md).
  ``OMP_NUM_THREADS`` / ``OMP_WAIT_POLICY`` set by the user always win.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = [
    "BusyWatch",
    "Precision",
    "ThreadPolicy",
    "cpu_flags",
    "cpu_kernels",
    "CPU_KERNEL_PINS",
    "pin_cpu_kernels",
    "kernel_pins_in_force",
    "apply_cli_thread_policy",
    "apply_thread_policy",
    "ALLOW_LARGE",
    "available_cpus",
    "available_memory_bytes",
    "busy_cpus",
    "check_fits",
    "training_bytes",
    "activation_bytes",
    "choose_precision",
    "choose_thread_policy",
    "cpu_has_native_bf16",
]


# ----------------------------------------------------------------------------------------------------------------
# Memory: plausibility before allocation

#: set to 1 on a machine that really holds a model larger than lapheads can see it has room for
ALLOW_LARGE = "LAPHEADS_ALLOW_LARGE"


def available_memory_bytes(device: str = "cpu") -> int | None:
    """Memory a new allocation may take on ``device``: CUDA's free memory, or the CPU's MemAvailable (plus free
    swap, which a process may still use); None where it cannot be read."""
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        return None
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        kib = int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])
    except (OSError, KeyError, ValueError):
        return None
    return min(kib * 1024, _address_space_left() or kib * 1024)


def _address_space_left() -> int | None:
    """What the process's address-space limit (``ulimit -v``, RLIMIT_AS) leaves beside what it maps already."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return max(0, soft - int(status["VmSize"].split()[0]) * 1024)
    except (ImportError, OSError, KeyError, ValueError):
        return None


def training_bytes(
    params: int,
    batch: int,
    tokens: int,
    width: int,
    depth: int,
    heads: int,
    vocab: int = 0,
    attention_maps: bool = True,
    activation_bytes: int = 4,
) -> int:
    """A lower bound on the memory one training step of a transformer takes, so that a refusal is a fact, not a
    guess: fp32 weights and gradients and one optimizer moment (12 bytes a parameter; AdamW keeps two); four
    width-sized tensors per token per block kept for backward (a real block keeps ~17, Korthikanti et al. 2022);
    where attention is not fused (the CPU, the textbook path) its attention matrix, one value per score per head;
    and one copy of the logits for a vocabulary. ``tokens`` is one sample's tokens (crops: call per crop and
    add); ``activation_bytes`` 2 under bf16 autocast (:func:`activation_bytes`)."""
    activations = batch * tokens * depth * 4 * width
    maps = batch * heads * tokens * tokens * depth if attention_maps else 0
    logits = batch * tokens * vocab
    return 12 * params + activation_bytes * (activations + maps + logits)


def activation_bytes(amp: object, device: str) -> int:
    """Bytes an activation takes for a config's ``amp`` before the precision is chosen: 2 under bf16 autocast
    (``True``, or ``auto`` on CUDA, where bf16 is the rule), else 4 (``auto`` on a CPU may pick bf16: 4 is the
    bound)."""
    return 2 if amp is True or (amp == "auto" and device == "cuda") else 4


def check_fits(what: str, nbytes: float, device: str = "cpu") -> None:
    """Refuse, before anything is allocated, a tensor set that cannot fit: ``what`` would take ``nbytes`` and the
    device has less. The message states the estimate; ``LAPHEADS_ALLOW_LARGE=1`` skips the check."""
    if os.environ.get(ALLOW_LARGE) == "1":
        return
    room = available_memory_bytes(device)
    if room is not None and nbytes > room:
        from lapheads.errors import InputError

        raise InputError(
            f"{what} needs at least ~{nbytes / 2**30:,.1f} GiB but {device} has {room / 2**30:,.1f} GiB available "
            f"(the smaller of free memory and the address-space limit); allowed: a smaller size, or {ALLOW_LARGE}=1 "
            "on a machine that holds it"
        )


# ----------------------------------------------------------------------------------------------------------------
# Precision


@dataclass(frozen=True)
class Precision:
    """Whether training / evaluation runs under bf16 autocast, and why (one phrase, for the log and config.json)."""

    autocast: bool
    reason: str

    def record(self) -> dict:
        return {"autocast_bf16": self.autocast, "reason": self.reason}


def full_fp32(device) -> None:
    """fp32 on a GPU as the CPU computes it: IEEE matrix products and convolutions, no TF32.

    torch leaves cuDNN convolutions (a ViT's patch embedding) in TF32, a 10-bit mantissa, by default; a run that
    chose fp32 (a study that pins its precision) gets fp32. No-op off CUDA.

    Args:
        device: a torch.device or its type.
    """
    if getattr(device, "type", device) == "cuda":
        import torch

        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# The variables that cap the instruction set each CPU kernel library dispatches to (read when torch loads): ATen's
# own kernels, MKL (torch's BLAS on x86) and oneDNN. Capping all three to AVX2 on an AVX-512 CPU reproduces an AVX2
# machine's fp32 training bit for bit (a fmnist-10k-converged-cpu cell's first 80 logged losses, measured on an
# AVX-512 EPYC against a record trained on an AVX2 one; unpinned, they differ in the last bits from step 20).
CPU_KERNEL_PINS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512", "DNNL_MAX_CPU_ISA": "AVX512_CORE"},
}


def pin_cpu_kernels(isa: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set (in ``environ``, default ``os.environ``) the variables that cap every CPU kernel library at ``isa``
    ("avx2" or "avx512"; "native" sets nothing); they act only on a torch that has not loaded yet (a child
    process). Returns the variables set. A CPU without ``isa`` is refused: a cap cannot add instructions."""
    from lapheads.errors import InputError

    environ = os.environ if environ is None else environ
    if isa == "native":
        return {}
    if isa not in CPU_KERNEL_PINS:
        raise InputError(f"--cpu-kernels {isa!r}; allowed: native, {', '.join(CPU_KERNEL_PINS)}")
    needed = {"avx2": "avx2", "avx512": "avx512f"}[isa]
    flags = cpu_flags()
    if flags and needed not in flags:
        raise InputError(f"--cpu-kernels {isa}: this CPU lacks {needed}; allowed: native or an instruction set it has")
    environ.update(CPU_KERNEL_PINS[isa])
    return dict(CPU_KERNEL_PINS[isa])


def kernel_pins_in_force(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The CPU kernel pins set in ``environ`` (default ``os.environ``): a record keeps them, a SLURM job gets them."""
    environ = os.environ if environ is None else environ
    names = sorted({name for pin in CPU_KERNEL_PINS.values() for name in pin})
    return {name: environ[name] for name in names if name in environ}


def cpu_kernels(flags: set[str] | list[str], capability: str | None, pins: dict[str, str] | None = None) -> dict:
    """The instruction set each CPU kernel library runs, from the CPU's kernel flags, torch's CPU capability (which
    already honours ATEN_CPU_CAPABILITY) and the pins in force: what decides a CPU run's numbers bit for bit."""
    pins = pins or {}
    best = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "OTHER"

    def capped(pin: str | None) -> str:
        return best if pin is None else ("AVX512" if pin.upper().startswith("AVX512") else pin.upper())

    return {
        "aten": str(capability),
        "mkl": capped(pins.get("MKL_ENABLE_INSTRUCTIONS")),
        "onednn": capped(pins.get("DNNL_MAX_CPU_ISA")),
    }


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX-512-BF16 or AMX-BF16; Apple/ARM: the bf16 extension)."""
    flags = cpu_flags()
    if flags & {"avx512_bf16", "amx_bf16", "bf16"}:
        return True
    if not flags:  # not Linux: ask torch what its kernels were built to use
        import torch

        capability = str(torch.backends.cpu.get_cpu_capability()).upper()
        return "AMX" in capability or "BF16" in capability
    return False


@functools.cache
def _bf16_probe_faster() -> tuple[bool, float]:
    """(bf16 autocast faster than fp32, fp32 time / bf16 time) on a small matmul + GELU chain, best of 3."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 384, generator=gen)
    w = torch.randn(384, 384, generator=gen)

    def run(autocast: bool) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = x
                for _ in range(8):
                    y = torch.nn.functional.gelu(y @ w)
            best = min(best, time.perf_counter() - start)
        return best

    run(True), run(False)  # warm-up: kernels chosen, caches filled
    ratio = run(False) / run(True)
    return ratio > 1.0, ratio


def choose_precision(amp: bool | str, device) -> Precision:
    """Resolve ``amp`` (true, false or "auto") for ``device`` (a torch.device or its type).

    Args:
        amp: the config value; true and false are obeyed as given, "auto" looks at the hardware.
        device: where the model runs.
    """
    kind = getattr(device, "type", device)
    if amp is True:
        return Precision(True, "bf16 autocast (amp = true)")
    if amp is False:
        full_fp32(kind)
        return Precision(False, "fp32 (amp = false)" + (", TF32 off" if kind == "cuda" else ""))
    if kind == "cuda":
        import torch

        if torch.cuda.is_bf16_supported():
            return Precision(True, "bf16 autocast: this GPU supports bf16 (amp = auto)")
        full_fp32(kind)
        return Precision(False, "fp32, TF32 off: this GPU has no bf16 (amp = auto)")
    if not cpu_has_native_bf16():
        return Precision(False, "fp32: this CPU has no native bf16, where autocast is ~20x slower (amp = auto)")
    faster, ratio = _bf16_probe_faster()
    if faster:
        return Precision(True, f"bf16 autocast: native bf16 CPU, measured {ratio:.2f}x fp32's speed (amp = auto)")
    return Precision(False, f"fp32: native bf16 CPU but bf16 measured {ratio:.2f}x fp32's speed (amp = auto)")


# ----------------------------------------------------------------------------------------------------------------
# Threads


def available_cpus() -> int:
    """CPUs this process may use: the affinity mask, capped by a cgroup v2/v1 CPU quota where one is set."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = None
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            quota = int(text[0]) / int(text[1])
    except (OSError, ValueError, IndexError):
        try:
            q = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
            p = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
            quota = q / p if q > 0 and p > 0 else None
        except (OSError, ValueError):
            pass
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return max(1, cpus)


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat, or None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def busy_cpus(sample_s: float = 0.2) -> float:
    """How many CPUs other processes keep busy now (0 off Linux), from /proc/stat over ``sample_s`` seconds."""
    first = _cpu_times()
    if first is None:
        return 0.0
    time.sleep(sample_s)
    second = _cpu_times()
    busy, total = second[0] - first[0], second[1] - first[1]
    if total <= 0:
        return 0.0
    return (os.cpu_count() or 1) * busy / total


@dataclass(frozen=True)
class ThreadPolicy:
    """The threads and OpenMP wait policy chosen for a command, and why."""

    threads: int
    passive_wait: bool
    reason: str
    busy: bool = False  # other processes held CPUs when the command started


def choose_thread_policy(threads: str | int = "auto", busy: float | None = None) -> ThreadPolicy:
    """``threads``: "auto" (free CPUs) or a count. ``busy``: CPUs kept busy by others (measured when None)."""
    cpus = available_cpus()
    if threads != "auto":
        count = int(threads)
        return ThreadPolicy(count, False, f"{count} thread(s) as asked (--threads)")
    busy = busy_cpus() if busy is None else busy
    others = min(cpus - 1, int(busy + 0.5))  # a neighbour at >= half a CPU counts as one
    count = cpus - others
    if others == 0:
        return ThreadPolicy(count, False, f"{count} thread(s): {cpus} CPU(s) available, idle")
    return ThreadPolicy(
        count,
        count > 1,
        f"the machine is busy: {count} thread(s) of {cpus} CPU(s), ~{busy:.1f} kept busy by other processes"
        + (", passive OpenMP wait" if count > 1 else ""),
        busy=True,
    )


def apply_thread_policy(threads: str | int = "auto", announce: bool = True) -> ThreadPolicy | None:
    """Choose and apply the thread policy of a ``lapheads`` command.

    The OpenMP wait policy only takes effect if set before torch is first imported, so the command line applies
    this as its first act. A user's own ``OMP_NUM_THREADS`` (with ``threads="auto"``) leaves everything as it is.
    """
    if threads == "auto" and "OMP_NUM_THREADS" in os.environ:
        return None
    policy = choose_thread_policy(threads)
    if policy.passive_wait and "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ["OMP_NUM_THREADS"] = str(policy.threads)
    if threads != "auto" and "MKL_NUM_THREADS" in os.environ:  # an explicit --threads is not silently capped
        os.environ["MKL_NUM_THREADS"] = str(policy.threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(policy.threads)
    if announce and policy.busy and os.environ.get(_BUSY_SAID) != "1":
        log.warning(f"lapheads: {policy.reason}; --threads N to choose")
        os.environ[_BUSY_SAID] = "1"  # once per command: BusyWatch and a sweep's cells (they inherit it) stay silent
    return policy


#: set once a command has said the machine is busy
_BUSY_SAID = "LAPHEADS_BUSY_SAID"


def threads_from_argv(argv: list[str]) -> str:
    """The value of ``--threads`` in a command line ("auto" when absent or malformed: argparse reports that)."""
    for i, item in enumerate(argv):
        if item == "--threads" and i + 1 < len(argv):
            value = argv[i + 1]
        elif item.startswith("--threads="):
            value = item.split("=", 1)[1]
        else:
            continue
        # a count this process cannot run is argparse's to refuse (lapheads.cli.parser), never applied before it
        return value if value == "auto" or (value.isdigit() and 0 < int(value) <= available_cpus()) else "auto"
    return "auto"


def apply_cli_thread_policy(argv: list[str]) -> None:
    """The ``lapheads`` command's first act (from ``lapheads/__init__``, before torch loads OpenMP)."""
    try:
        # a help or version request computes nothing: the threads are still set, the busy line is not said
        quiet = bool({"-h", "--help", "--version"} & set(argv))
        apply_thread_policy(threads_from_argv(argv), announce=not quiet)
    except Exception:  # noqa: BLE001 - choosing threads must never stop a command; OpenMP's default stays
        pass


class BusyWatch:
    """Says once, in one line, when training slows down because the machine is busy.

    After ``skip`` warm-up steps, the median of the next ``measure`` step times is the machine's own pace; a later
    step slower than ``factor`` times that pace, or a 1-minute load average above the CPUs this process may use
    plus one (other jobs beside ours), triggers the line. Call :meth:`begin` as a step starts and :meth:`step`
    when it ends (evaluations and checkpoints in between are not counted).
    """

    def __init__(self, skip: int = 2, measure: int = 5, factor: float = 3.0) -> None:
        self.skip, self.measure, self.factor = skip, measure, factor
        self.times: list[float] = []
        self.last = time.perf_counter()
        self.said = os.environ.get(_BUSY_SAID) == "1"  # the command said so at its start: once is enough
        self.cpus = available_cpus()

    def begin(self) -> None:
        self.last = time.perf_counter()

    def step(self) -> str | None:
        took = time.perf_counter() - self.last
        if self.said:
            return None
        if len(self.times) < self.skip + self.measure:  # only the first steps are kept: they set the pace
            self.times.append(took)
            return None
        pace = sorted(self.times[self.skip :])[self.measure // 2]
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
        slow = took > self.factor * pace
        if not slow and load <= self.cpus + 1:
            return None
        self.said = True
        why = f"a step took {took / pace:.1f}x the first steps' time" if slow else ""
        if load > self.cpus + 1:
            why += (", and " if why else "") + f"the load average is {load:.1f} on {self.cpus} CPU(s)"
        import torch

        threads = torch.get_num_threads()
        advice = (  # one thread already: fewer cannot help
            "close other jobs, or restart with --threads 1 (and --resume) to share the CPUs without stalls"
            if threads > 1
            else "close other jobs (this run already uses one thread)"
        )
        return f"lapheads: the machine is busy ({why}); the ETA assumes it stays so: {advice}"
