"""What every training loop shares: starting or resuming a run, checkpoints, batching, RNG state, stops.

Design choices:

* **torchrun only** (``lapheads.distributed``): no home-made launcher.
* **Global batches are defined once.** ``GlobalBatchSampler`` shuffles with (seed, epoch) and cuts each global
  batch into world_size x accum_steps micro-batches, so 1 rank and N ranks see the same samples per optimizer
  step, and a resumed run continues mid-epoch at the exact next batch. ``step_loader`` reads them (in the trainer or
  ahead in worker processes) with each micro-batch's random transforms seeded by (seed, rank, step, its place), so
  what a step trains on depends on nothing else: not the worker count, not where a run was resumed.
* **Checkpoints without pickle.** Weights, optimizer tensors and RNG states are safetensors; everything else is
  JSON. A checkpoint is written into a temporary folder, then renamed into place, then ``latest`` is replaced
  atomically: a crash at any point leaves the previous checkpoint intact.
* **The run directory is the contract** (``lapheads.runs`` owns it): config.json (the full config, seed, versions,
  the model's constructor arguments), metrics.jsonl, and checkpoints/step-<N>/ with checkpoints/latest; readers
  never need anything else.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lapheads.config import ConfigError
from lapheads.core import native
from lapheads.distributed import Distributed
from lapheads.errors import CheckpointError, InputError
from lapheads.hardware import BusyWatch, Precision, choose_precision, full_fp32
from lapheads.runs import (
    RunDir,
    latest_checkpoint,
)
from lapheads.runs.checkpoints import NonFiniteLossError, kept_checkpoint, load_checkpoint
from lapheads.runs.layout import (
    CHECKPOINTS,
    METRICS_FILE,
)
from lapheads.train.configs.run import RESUME_FREE

log = logging.getLogger(__name__)

__all__ = [
    "training_progress",
    "StepClock",
    "grad_sync",
    "start_or_resume",
    "wrap_for_training",
    "GlobalBatchSampler",
    "step_loader",
    "seeded",
    "run_precision",
    "check_finite_loss",
    "seed_everything",
]


class _LineProgress:
    """The progress of a run whose stderr is not a terminal (a log file, a SLURM job, a sweep cell): tqdm's
    carriage-return redraws and bar glyphs would fill a file with one unreadable line, so this prints one plain line
    every ``interval`` seconds and at the end ("train: 120/2340 steps (5%), 2:01 elapsed, ~37:10 left, loss=..."),
    with the members the training loops use (update, set_postfix, write, close, n)."""

    def __init__(self, total: int, initial: int, desc: str, disable: bool, interval: float = 30.0) -> None:
        self.total, self.n, self.desc, self.disable, self.interval = total, initial, desc, disable, interval
        self.postfix, self.start, self.started_at = "", initial, time.monotonic()
        self.last_line, self.last_n = self.started_at, None

    def update(self, steps: int = 1) -> None:
        self.n += steps
        if time.monotonic() - self.last_line >= self.interval:
            self._line()

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def write(self, text: str) -> None:
        if not self.disable:
            log.info(text)

    def close(self) -> None:
        if self.last_n != self.n:
            self._line()

    def _line(self) -> None:
        self.last_line, self.last_n = time.monotonic(), self.n
        if self.disable:
            return
        elapsed = self.last_line - self.started_at
        done = self.n - self.start
        left = f", ~{_clock(elapsed / done * (self.total - self.n))} left" if done and self.n < self.total else ""
        percent = 100 * self.n / self.total if self.total else 100.0
        postfix = f", {self.postfix}" if self.postfix else ""
        log.info(f"{self.desc}: {self.n}/{self.total} steps ({percent:.0f}%), {_clock(elapsed)} elapsed{left}{postfix}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


def training_progress(total: int, initial: int, desc: str, disable: bool):
    """The training loops' progress: tqdm's bar on a terminal, plain lines every 30 s elsewhere (_LineProgress)."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, disable=disable, desc=desc, dynamic_ncols=True)
    return _LineProgress(total, initial, desc, disable)


class StepClock:
    """The bookkeeping every training loop repeats around its step, so the loops keep only their own work.

    It owns the progress bar (``progress``: tqdm or plain lines), the one busy-machine line (``BusyWatch``), the
    ``stop_at_step`` exit the resume tests use, the throughput between log lines, and which steps are due for a log
    line, an evaluation or a checkpoint (every N steps, and always the last). A loop reads::

        while step < total:
            if not clock.begin(step):
                return {"step": step, "stopped": True}
            ...  # forward, backward, optimizer step
            step += 1
            clock.end(examples)
            if clock.due(step, cfg.log_every):
                seconds, rate = clock.lap()
    """

    def __init__(self, total: int, start: int, desc: str, *, main: bool, stop_at_step: int | None = None) -> None:
        """``total`` steps from ``start``; ``main``: this process writes the bar; ``stop_at_step``: stop there as
        if killed."""
        self.total, self.main, self.stop_at_step = total, main, stop_at_step
        self.progress = training_progress(total, start, desc, disable=not main)
        self.busy = BusyWatch()  # one line when the machine is busy: the ETA is then not the machine's own pace
        self.tick, self.seen = time.perf_counter(), 0

    def begin(self, step: int) -> bool:
        """A step starts (evaluations and checkpoints before it are not its pace); False, with the bar closed, when
        ``stop_at_step`` says to stop here."""
        self.busy.begin()
        if self.stop_at_step is not None and step >= self.stop_at_step:
            self.progress.close()
            return False
        return True

    def end(self, examples: int = 0) -> None:
        """A step ended, having seen ``examples`` (tokens or images, over every process)."""
        self.seen += examples
        self.progress.update(1)
        if (busy_line := self.busy.step()) and self.main:
            self.progress.write(busy_line)

    def due(self, step: int, *every: int) -> bool:
        """Whether ``step`` (the steps done) is the last or a multiple of one of ``every`` (0: never)."""
        return step == self.total or any(n and step % n == 0 for n in every)

    def lap(self) -> tuple[float, float]:
        """Seconds since the last lap and examples per second over them; starts the next lap."""
        now = time.perf_counter()
        seconds = now - self.tick
        rate = self.seen / seconds if seconds > 0 else 0.0
        self.tick, self.seen = now, 0
        return seconds, rate

    def close(self) -> None:
        self.progress.close()


def grad_sync(train_model: torch.nn.Module, dist_: Distributed, last: bool):
    """The context of one micro-batch's backward: DDP all-reduces the gradients on the ``last`` micro-batch of a
    step only (``no_sync`` on the others); one process needs neither."""
    return contextlib.nullcontext() if last or not dist_.enabled else train_model.no_sync()


def check_finite_loss(mean_loss: float, step: int, run: RunDir, hint: str, progress=None) -> None:
    """Stop a run before a NaN/inf loss reaches the optimizer: one-line error naming the (1-based) step, the
    intact checkpoint (or that there is none) and ``hint`` (the options that usually cure it); closes the tqdm
    ``progress`` bar first."""
    if math.isfinite(mean_loss):
        return
    if progress is not None:
        progress.close()
    raise NonFiniteLossError(
        f"non-finite loss {mean_loss} at step {step + 1}; stopped before the optimizer step; "
        f"{kept_checkpoint(run)} ({hint})"
    )


def optimizer_step(optimizers: list[torch.optim.Optimizer], step: int, run: RunDir, hint: str, progress=None) -> None:
    """``opt.step()`` for each optimizer; a numeric overflow inside one (a learning rate so large that a scalar no
    longer fits the parameter dtype) stops the run like a NaN loss, naming the step and the kept checkpoint."""
    for opt in optimizers:
        try:
            opt.step()
        except (RuntimeError, OverflowError) as err:
            if "overflow" not in str(err).lower():
                raise
            if progress is not None:
                progress.close()
            raise NonFiniteLossError(
                f"numeric overflow in the {type(opt).__name__} step at step {step + 1} "
                f"({str(err).splitlines()[0][:80]}); {kept_checkpoint(run)} ({hint})"
            ) from None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------------
# Batching


class GlobalBatchSampler:
    """Yields this rank's micro-batches of indices, epoch by epoch, from a given global step on.

    Global batch b of epoch e is ``order_e[b * G : (b + 1) * G]`` with G = world_size * accum_steps * micro_batch
    and ``order_e`` a permutation seeded by (seed, e), each index repeated ``repeats`` times in a row and cut to the
    dataset's length; rank r's micro-batch a is the slice ``[(a * world_size + r) * micro_batch, ... +
    micro_batch)``. Incomplete last global batches are dropped.

    With ``repeats`` > 1 this is repeated augmentation (DeiT's RASampler, timm's ``RepeatAugSampler``): an epoch
    keeps its length but draws 1 / repeats of the images, each that many times in a row (so in one global batch
    where G is a multiple of ``repeats``), every copy augmented on its own. A step's global batch is what
    ``RepeatAugSampler`` gives all the ranks at that step (it strides the repeated order across ranks, each rank
    here takes a contiguous slice: the same mean gradient, as no layer here normalises across a batch), shuffled by
    (seed, epoch) rather than the epoch alone, so that seeds differ in their data order.

    Args:
        num_samples: dataset length.
        micro_batch: samples per forward pass per rank.
        accum_steps: micro-batches per optimizer step.
        rank, world_size: this process and the number of processes.
        seed: shuffling seed.
        repeats: copies of each drawn index in a row (1: every index once an epoch).
    """

    def __init__(
        self,
        num_samples: int,
        micro_batch: int,
        accum_steps: int,
        rank: int,
        world_size: int,
        seed: int,
        repeats: int = 1,
    ) -> None:
        if repeats < 1:
            raise InputError(f"repeats={repeats}; allowed: an integer >= 1 (1: every image once an epoch)")
        self.num_samples, self.micro_batch, self.accum_steps = num_samples, micro_batch, accum_steps
        self.rank, self.world_size, self.seed, self.repeats = rank, world_size, seed, repeats
        self.global_batch = micro_batch * accum_steps * world_size
        self.steps_per_epoch = num_samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise InputError(
                f"global batch {self.global_batch} is larger than the dataset ({num_samples} samples); allowed: "
                f"batch_size <= {num_samples}"
            )

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The indices of epoch ``epoch`` in the order the global batches cut them (the permutation itself when
        ``repeats`` is 1)."""
        perm = self.epoch_permutation(epoch)
        return perm if self.repeats == 1 else perm.repeat_interleave(self.repeats)[: self.num_samples]

    def step_batches(self, start_step: int) -> Iterator[tuple[int, list[list[int]]]]:
        """(global step, this rank's accum_steps micro-batches) from ``start_step`` on, forever."""
        step = start_step
        while True:
            epoch, b = divmod(step, self.steps_per_epoch)
            order = self.epoch_order(epoch)
            while b < self.steps_per_epoch:
                batch = order[b * self.global_batch : (b + 1) * self.global_batch]
                micro = []
                for a in range(self.accum_steps):
                    start = (a * self.world_size + self.rank) * self.micro_batch
                    micro.append(batch[start : start + self.micro_batch].tolist())
                yield step, micro
                step, b = step + 1, b + 1


@contextlib.contextmanager
def seeded(*key: int) -> Iterator[None]:
    """Python's, NumPy's and torch's global generators seeded by ``key`` (non-negative integers) inside the block and
    restored after it: what is drawn inside is a function of the key alone, and what is drawn outside is untouched."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    seed_everything(int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0]) >> 1)  # < 2**63
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


class _MicroBatches(Dataset):
    """Item (step, a, indices): micro-batch ``a`` of ``step``, read and transformed under :func:`seeded` (seed,
    rank, step, a) and collated, wherever it is loaded."""

    def __init__(self, dataset: Dataset, collate: Callable[[list[Any]], Any], seed: int, rank: int) -> None:
        self.dataset, self.collate, self.seed, self.rank = dataset, collate, seed, rank

    def __getitem__(self, key: tuple[int, int, list[int]]) -> tuple[int, int, Any]:
        step, a, indices = key
        with seeded(self.seed, self.rank, step, a):
            return step, a, self.collate([self.dataset[i] for i in indices])


def _as_loaded(item: Any) -> Any:
    return item  # a micro-batch comes collated from _MicroBatches


def _ignore_interrupts(worker_id: int) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle (a checkpoint, then a stop)


def step_loader(
    dataset: Dataset,
    sampler: GlobalBatchSampler,
    start_step: int,
    collate: Callable[[list[Any]], Any],
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[tuple[int, list[Any]]]:
    """(global step, this rank's ``accum_steps`` collated micro-batches) from ``start_step`` on, forever: what
    ``sampler`` cuts, read from ``dataset`` and collated by ``collate`` (a list of items -> a batch).

    Every micro-batch's random transforms are seeded by (the sampler's seed, its rank, the step, its place in the
    step) (:func:`seeded`), so a batch is the same whether it is loaded here or in any of ``num_workers`` worker
    processes, and a run resumed at any step reads the batches an uninterrupted one reads; the global generators
    (drop-path, Mixup) see no draw of the loading. With ``num_workers`` > 0 (``torch.utils.data.DataLoader``)
    batches load ahead, in order, while the model trains: the speed an ImageNet recipe needs.
    """
    keys = ((step, a, indices) for step, micro in sampler.step_batches(start_step) for a, indices in enumerate(micro))
    loader = DataLoader(
        _MicroBatches(dataset, collate, sampler.seed, sampler.rank),
        batch_size=None,  # each key is a whole micro-batch
        sampler=keys,
        num_workers=num_workers,
        collate_fn=_as_loaded,
        pin_memory=pin_memory,
        worker_init_fn=_ignore_interrupts if num_workers else None,
        generator=torch.Generator(),  # its base seed drawn from its own generator: the global one sees no draw
    )
    batches: list[Any] = []
    for step, a, batch in loader:
        batches.append(batch)
        if a == sampler.accum_steps - 1:
            yield step, batches
            batches = []


# ----------------------------------------------------------------------------------------------------------------
# Run directory


def start_or_resume(
    run: RunDir,
    task: str,
    config: dict[str, Any],
    dist_: Distributed,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | dict[str, torch.optim.Optimizer],
    *,
    resume: bool,
    extra_record: dict[str, Any],
    extra_models: dict[str, torch.nn.Module] | None = None,
    logs: tuple[str, ...] = (METRICS_FILE,),
    config_type: type | None = None,
) -> int:
    """Begin a run in ``run`` and return the step to start from.

    A new run refuses a folder that already holds one (a config.json *and* a checkpoint; a run that died before
    its first checkpoint is started over) and writes config.json (the config plus ``extra_record``). A resumed run
    must have the same config; it repairs what a kill can leave (a half-written checkpoint folder, a torn last log
    line), loads the latest checkpoint (if any) and drops log records written after it, so the continued run writes
    them again.
    """
    run.check_is_directory()
    if config.get("log"):
        from lapheads.integrations.tracking import check_trackers

        check_trackers(config["log"])  # a missing package: one line, before anything is written
    start_step = 0
    if resume:
        saved = run.read_config().get("config", {})
        # a field added to lapheads after the run was written counts as unchanged while it has its default value
        defaults = defaults_of(config_type) if config_type is not None else {}
        changed = sorted(
            k for k in config if k not in RESUME_FREE and saved.get(k, defaults.get(k, _MISSING)) != config[k]
        )
        if changed:
            raise ConfigError(f"--resume with a config that differs from {run.config_file} in: {', '.join(changed)}")
        if dist_.is_main:
            run.claim()  # before the repair: two resumers must not both repair and continue one folder
            run.repair(logs)
        dist_.barrier()
        folder = latest_checkpoint(run)
        if folder is not None:
            start_step = load_checkpoint(folder, dist_, model, optimizer, extra_models)["step"]
        if dist_.is_main:
            found = _check_the_log_reaches(run, start_step, int(config.get("log_every") or 0))
            _say_if_the_kernels_changed(run, dist_.device)
            log.info(
                f"lapheads: resuming {run.path} from step {start_step} ({folder.name}; {found})"
                if folder is not None
                else f"lapheads: {run.path} holds no checkpoint yet: starting it over from step 0 with its stored "
                "config"
            )
        if dist_.is_main:
            for name in logs:
                run.truncate_log(name, start_step)
    elif dist_.is_main:
        if run.config_file.exists() or run.config_file.is_symlink():
            _check_owned(run, task)
            run.claim()  # ours: held before it is started over (a run still training it is not cut short)
            if latest_checkpoint(run) is not None:
                raise ConfigError(
                    f"{run.path} already holds a run; use --resume to continue it or choose another --out"
                )
            log.warning(f"lapheads: {run.path} holds a run that never wrote a checkpoint; starting it over")
            for name in logs:
                (run.path / name).unlink(missing_ok=True)
        elif found := [n for n in (*logs, CHECKPOINTS) if (run.path / n).exists() or (run.path / n).is_symlink()]:
            # config.json comes first: logs or a checkpoints folder without it are not ours (a run writes into them)
            raise ConfigError(
                f"{run.path} holds {', '.join(found)} but no config.json: not a lapheads run; refusing to write there "
                "(nothing was changed); allowed: a new --out"
            )
        from lapheads.runs.records import environment

        threads = torch.get_num_threads()
        record = {"world_size": dist_.world_size, "threads": threads, "environment": environment(threads, dist_.device)}
        run.claim()  # the folder is a new run's or an unstarted one of ours: one writer from here on
        run.write_config(task, config, {**record, **extra_record})
    if dist_.is_main and isinstance(extra_record.get("precision"), dict):
        log.info(f"lapheads: precision: {extra_record['precision']['reason']}")
    if dist_.is_main and dist_.device.type == "cpu" and native.enabled() and native.module() is None:
        log.warning(  # the defaults should be fast on the user's CPU: say once how to get the compiled node
            "lapheads: attention: the op's compiled CPU node is not built, so it runs its Python node (the same "
            "numbers, ~2% slower per attention call at small shapes); `lapheads kernel build` compiles it once (~30 s)"
        )
    if dist_.is_main and config.get("log"):
        from lapheads.integrations.tracking import open_trackers

        run.trackers = open_trackers(config["log"], run.path, config, start_step)
    dist_.barrier()
    return start_step


_MISSING = object()


def _check_the_log_reaches(run: RunDir, step: int, log_every: int) -> str:
    """A resumed run continues its metrics.jsonl: the log must reach the checkpoint's step (one training record
    every ``log_every`` steps), or the continued run would leave a silent gap. Returns what was found, for the
    resume line; a gap is refused in one line (nothing is changed)."""
    from lapheads.runs.directory import read_jsonl

    records, _ = read_jsonl(run.path / METRICS_FILE)
    trained = [r["step"] for r in records if isinstance(r.get("step"), int) and "loss" in r and r["step"] <= step]
    expected = step // log_every if log_every else 0
    last = max(trained, default=0)
    if log_every and step >= log_every and last <= step - log_every:
        raise CheckpointError(
            f"{run.path / METRICS_FILE} ends at step {last} ({len(trained)} training records) but the checkpoint is "
            f"at step {step}, a record every {log_every} steps: ~{expected - len(trained)} records are gone; allowed: "
            "restore metrics.jsonl, or train into a new --out (nothing was changed)"
        )
    return f"{METRICS_FILE}: {len(trained)} training records up to step {last}"


def _say_if_the_kernels_changed(run: RunDir, device: torch.device) -> None:
    """A run resumed where other kernels run (another CPU, another torch, other threads) goes on, but no longer
    matches a run trained in one place bit for bit: say so once (its config.json keeps where it started)."""
    import torch

    from lapheads.runs.records import environment, environment_key

    started = run.read_config().get("environment")
    if not started:
        return
    here = environment(torch.get_num_threads(), device)
    then, now = environment_key({**started, "precision": None}), environment_key({**here, "precision": None})
    if then != now:

        def said(key: tuple) -> str:  # torch, the kernels of each library, the architecture, threads, the GPU
            gpu = f", {key[5][0]} ({key[5][1]} matmul, {key[5][2]} conv)" if key[5] else ""
            return f"torch {key[0]}, {' '.join(f'{lib} {isa}' for lib, isa in key[1])}, {key[2]}, {key[3]} threads{gpu}"

        log.warning(
            f"lapheads: {run.path} started on {said(then)} and resumes on {said(now)}: its numbers will not match a "
            "run trained in one place bit for bit (config.json keeps where it started)"
        )


def _check_owned(run: RunDir, task: str) -> None:
    """Starting over deletes logs: only in a folder whose config.json is lapheads' record of a ``task`` run."""
    try:
        record = run.read_config() if not run.config_file.is_symlink() else None
    except CheckpointError:
        record = None
    if not (isinstance(record, dict) and record.get("task") == task and isinstance(record.get("config"), dict)):
        raise ConfigError(
            f"{run.path} holds a config.json that is not lapheads' record of a {task} run; refusing to start over "
            "there (nothing was changed); allowed: a new --out, or a {task} run directory".replace("{task}", task)
        )


def run_precision(run: RunDir, amp: bool | str, dist_: Distributed, resume: bool) -> Precision:
    """The run's autocast choice: on --resume the one config.json recorded (a run keeps its precision whatever
    machine continues it), else chosen for this device (:func:`lapheads.hardware.choose_precision`); trainers record
    ``precision.record()`` as config.json's ``precision`` and start_or_resume announces it."""
    if resume and run.config_file.exists():
        saved = run.read_config().get("precision")
        if isinstance(saved, dict) and isinstance(saved.get("autocast_bf16"), bool):
            if not saved["autocast_bf16"]:
                full_fp32(dist_.device)
            return Precision(saved["autocast_bf16"], str(saved.get("reason", "recorded")) + ", kept on resume")
    return choose_precision(amp, dist_.device)  # start_or_resume announces it, once the run is known to start


def defaults_of(config_type: type) -> dict[str, Any]:
    """Every field's default value of a config dataclass (as ``dataclasses.asdict`` writes it)."""
    import dataclasses

    return dataclasses.asdict(config_type())


def wrap_for_training(
    model: torch.nn.Module, dist_: Distributed, compile_model: bool
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the DDP-wrapped model, for no_sync; the module to call: compiled when asked)."""
    train_model: torch.nn.Module = model
    if dist_.enabled:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(
            model, device_ids=[dist_.local_rank] if dist_.device.type == "cuda" else None
        )
    return train_model, (torch.compile(train_model) if compile_model else train_model)
