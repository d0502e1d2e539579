"""torchrun processes: joining the process group, the device, collectives that fail in one line.

Design choices:

* **torchrun only.** ``setup_distributed`` reads the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK) and
  initialises gloo on CPU, nccl on CUDA; without them the run is a single process. No home-made launcher.
* **A lost peer is one line.** A collective that fails because another rank died, and torchrun's SIGTERM to the
  survivors, end the process with a one-line message that says the written checkpoints are intact.

Training and the distributed evaluations (validation bpb) both use it, so it sits below both.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lapheads.errors import InputError, LapheadsError

__all__ = [
    "Distributed",
    "Interrupted",
    "StopRequests",
    "StoppedError",
    "peer_failures",
    "resolve_device",
    "setup_distributed",
    "stop_signals",
]


class StoppedError(LapheadsError, RuntimeError):
    """The run was stopped from outside (SIGTERM from torchrun after another rank died, a cancelled job) or lost a
    peer process; what was written stays, and ``--resume`` continues."""


class Interrupted(StoppedError):
    """Ctrl-C or SIGTERM in a one-process run: the step in progress finished and was checkpointed; the command
    exits 130 (the shell's code for an interrupted program) with one line saying where it stopped."""

    exit_code = 130


# The signals a one-process training loop takes as "stop after this step"; a SLURM job (lapheads.study.slurm) swaps
# SIGTERM, which submitit leaves to SLURM, for the signal that announces pre-emption or the time limit (USR2).
_STOP_SIGNALS: list[tuple[int, ...]] = [(signal.SIGINT, signal.SIGTERM)]


@contextlib.contextmanager
def stop_signals(*signums: int) -> Iterator[None]:
    """Within the block, :class:`StopRequests` answers ``signums`` instead of SIGINT and SIGTERM."""
    _STOP_SIGNALS.append(tuple(signums))
    try:
        yield
    finally:
        _STOP_SIGNALS.pop()


class StopRequests:
    """SIGINT / SIGTERM (or the signals of :func:`stop_signals`) while a one-process run trains become a request the
    loop answers at the end of its step (checkpoint, one line, exit 130) instead of a traceback that loses every
    step since the last checkpoint. A second signal while the checkpoint is written is taken as "stop now"
    (Python's default). Inactive in torchrun jobs, where the ranks would have to agree on the step (torchrun's own
    SIGTERM handling stays), and off the main thread, where signals cannot be caught."""

    def __init__(self, active: bool = True) -> None:
        self.active = active and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequests":
        if self.active:
            for signum in _STOP_SIGNALS[-1]:
                self._previous[signum] = signal.signal(signum, self._request)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _request(self, signum: int, frame: object) -> None:
        if self.signum is not None:  # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stop_if_requested(self, step: int, where: object, progress: Any = None) -> None:
        """Raise :class:`Interrupted` after the caller has checkpointed ``step`` (``where``: the run directory);
        the progress bar is closed first, so the line stands on its own."""
        if self.signum is not None:
            if progress is not None:
                progress.close()
            raise Interrupted(
                f"interrupted ({signal.Signals(self.signum).name}) at step {step}; saved a checkpoint of step {step} "
                f"in {where}; --resume continues from it"
            )


_RESUME_HINT = "checkpoints written so far are intact; run the same command with --resume to continue"


def _stop_on_sigterm(signum: int, frame: object) -> None:
    # Say why in one line and exit here: the signal may land anywhere (inside the CLI's error handling, during
    # interpreter shutdown), where an exception would print a traceback instead. SystemExit prints none.
    print(
        f"lapheads: error: stopped by signal {signal.Signals(signum).name} (another process of this torchrun job "
        f"failed, or the job was cancelled); {_RESUME_HINT}",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(2)


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            with peer_failures():
                dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            with peer_failures():
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """A collective that fails because a peer process died (in our code or inside DDP's hooks) becomes one line;
    any other error passes through unchanged."""
    try:
        yield
    except RuntimeError as err:  # DistBackendError and gloo's errors are RuntimeErrors
        text = str(err).lower()
        if isinstance(err, LapheadsError) or not (
            isinstance(err, dist.DistError) or "gloo" in text or "nccl" in text or "by peer" in text
        ):
            raise
        raise StoppedError(
            f"lost contact with another process of this job ({str(err).splitlines()[0][:80]}); {_RESUME_HINT}"
        ) from None


def resolve_device(device: str | torch.device) -> torch.device:
    """ "auto" -> cuda when available, else cpu; anything else as torch reads it (a single-process reader's device)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"--device {device!r}; allowed: auto, cpu, cuda, cuda:N") from None
    if resolved.type not in ("cpu", "cuda"):  # meta, mps, xpu...: no reader here computes there (issue 76)
        raise InputError(f"--device {device!r}; allowed: auto, cpu, cuda, cuda:N")
    if resolved.type == "cuda" and not torch.cuda.is_available():  # a traceback deep in a reader before (issue 60)
        raise InputError(f"--device {device!r} but no CUDA device is available here; allowed here: cpu or auto")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise InputError(f"--device {device!r}; allowed: cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return resolved


def setup_distributed(device: str = "auto") -> Distributed:
    """Join the torchrun process group if launched by torchrun; pick the device ("auto", "cpu", "cuda")."""
    if device == "auto":
        device = resolve_device(device).type
    if device not in ("cpu", "cuda"):
        raise InputError(f"device={device!r}; allowed: auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("device='cuda' but no CUDA device is available; allowed here: cpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(torch_device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30))
    if "TORCHELASTIC_RUN_ID" in os.environ and threading.current_thread() is threading.main_thread():
        # torchrun stops the other ranks with SIGTERM when one dies: say so in one line instead of vanishing.
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    return Distributed(rank, world_size, local_rank, torch_device)
