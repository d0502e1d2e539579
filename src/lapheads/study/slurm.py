"""SLURM through submitit: a sweep's cells as a job array, multi-node training, pre-emption as the normal case.

Design choices:

* **submitit does the SLURM work** (sbatch scripts, job arrays, the pickled call, states from sacct, requeue), as in
  DINOv2's ``run/submit.py``; lapheads adds the job callables, the sweep folder's ledger of job ids and one-line
  errors. The local process pool (``--executor local``) stays the default.
* **One job per cell**, all of a sweep's new cells in one array (``executor.batch()``); ``--slurm-array-parallelism``
  caps how many run at once. Each job trains its cell (resuming its run directory when it holds one) and writes the
  cell's record itself, with the same builder a local sweep uses, so the records are the same.
* **A rerun never submits a cell twice.** sweep.json keeps each cell's job id; ``lapheads sweep`` on the folder
  again asks SLURM (squeue, else sacct) for each state, leaves pending, running and requeued cells alone, and
  resubmits only cells whose job is over without a finished run (failed, cancelled, timed out, vanished), saying so
  with the last lines of the job's log.
* **Pre-emption is normal.** sbatch asks for USR2 90 s before the time limit (submitit's default), and a cluster
  whose slurmctld has ``SlurmctldParameters=preempt_send_user_signal`` sends it at pre-emption too. A one-process
  job's training loop takes USR2 as a stop request (:func:`lapheads.distributed.stop_signals`): it finishes its
  step, checkpoints it, and the job hands over to submitit, which requeues the same call; the requeued job resumes
  from that checkpoint on the uninterrupted trajectory (bit-identical resume). SIGTERM stays submitit's (which
  ignores it: SLURM sends it beside the user signal); ``scancel`` still ends a job. A multi-task job leaves USR2 to
  submitit on rank 0 and resumes from its last periodic checkpoint (the ranks would have to agree on the step).
* **Multi-node training**: one task per GPU (or ``--slurm-tasks-per-node`` on CPUs); each task exports
  torch.distributed's variables from SLURM's (``submitit.helpers.TorchDistributedEnvironment``), as torchrun
  would, and :func:`lapheads.distributed.setup_distributed` joins the group as under torchrun.
* **Threads**: a task uses the CPUs SLURM gave it (``SLURM_CPUS_PER_TASK``); CPU kernel pins travel in the
  job's environment (sbatch exports the submitting environment, and the pins are set in the script too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lapheads.errors import InputError, LapheadsError
from lapheads.log import get_verbosity, set_verbosity

log = logging.getLogger(__name__)

__all__ = [
    "ACTIVE_STATES",
    "SlurmError",
    "SlurmOptions",
    "CellJob",
    "CellJobInput",
    "TrainJob",
    "submit_cells",
    "submit_training",
]

#: rounds of wait_for a job may be unknown to both sacct and squeue before it counts as lost
VANISHED_ROUNDS = 5
#: states in which a job still holds (or will hold) its cell: never submitted again
ACTIVE_STATES = frozenset(
    {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING", "RESIZING",
     "SUSPENDED", "PREEMPTED", "SIGNALING", "STAGE_OUT"}
)  # fmt: skip


class SlurmError(LapheadsError):
    """SLURM refused or lost a job: the message says what SLURM said, in one line."""


@dataclass(frozen=True)
class SlurmOptions:
    """What each job asks SLURM for.

    Args:
        partition: the partition (default: the cluster's default partition).
        time_minutes: the time limit of one job; a job that reaches it checkpoints and requeues.
        cpus_per_task: CPUs of one task (its torch threads).
        gpus_per_node: GPUs per node; training starts one task per GPU.
        tasks_per_node: tasks per node without GPUs (CPU training with gloo).
        nodes: nodes of one job (training only; a sweep cell is one node).
        array_parallelism: a sweep's cells running at once.
        sbatch: other sbatch options, as ``KEY=VALUE`` (``account=proj``, ``qos=high``, ``constraint=a100``).
    """

    partition: str | None = None
    time_minutes: int = 60
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int = 1
    nodes: int = 1
    array_parallelism: int = 256
    sbatch: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        flags = {"time_minutes": "--slurm-time", "cpus_per_task": "--slurm-cpus-per-task", "nodes": "--nodes",
                 "tasks_per_node": "--slurm-tasks-per-node",
                 "array_parallelism": "--slurm-array-parallelism"}  # fmt: skip
        for name, flag in flags.items():
            if getattr(self, name) < 1:
                raise InputError(f"{flag} {getattr(self, name)}; allowed: an integer >= 1")
        if self.gpus_per_node < 0:
            raise InputError(f"--slurm-gpus-per-node {self.gpus_per_node}; allowed: an integer >= 0")
        self.additional_parameters()  # bad --slurm-option values: refused before anything is submitted

    def additional_parameters(self) -> dict[str, str]:
        out = {}
        for item in self.sbatch:
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or key.strip().startswith("-"):
                raise InputError(f"--slurm-option {item!r}; allowed: KEY=VALUE, an sbatch option without its dashes")
            out[key.strip().replace("-", "_")] = value
        return out

    def tasks(self) -> int:
        """Tasks per node: one per GPU where there are GPUs."""
        return self.gpus_per_node or self.tasks_per_node


def _submitit():
    try:
        import submitit
    except ImportError:
        raise InputError("--executor slurm needs submitit; allowed: pip install 'lapheads[slurm]'") from None
    if shutil.which("sbatch") is None:
        raise SlurmError(
            "--executor slurm: sbatch is not on PATH (not a SLURM login node); allowed: --executor local, or a "
            "machine where sbatch runs (a one-node cluster for trying it: tests/slurm/localhost_cluster.sh)"
        )
    return submitit


def _executor(folder: Path, options: SlurmOptions, name: str, pins: dict[str, str], tasks: int, nodes: int):
    submitit = _submitit()
    executor = submitit.SlurmExecutor(folder=str(folder / "%j"), max_num_timeout=3)
    parameters: dict[str, Any] = {
        "job_name": name,
        "time": options.time_minutes,
        "cpus_per_task": options.cpus_per_task,
        "ntasks_per_node": tasks,
        "nodes": nodes,
        "array_parallelism": options.array_parallelism,
        "signal_delay_s": 90,  # USR2 this long before the time limit: time to finish a step and checkpoint it
        "setup": [f"export {key}={value}" for key, value in pins.items()],
        "additional_parameters": options.additional_parameters(),
    }
    if options.partition:
        parameters["partition"] = options.partition
    if options.gpus_per_node:
        parameters["gpus_per_node"] = options.gpus_per_node
    executor.update_parameters(**parameters)
    return executor


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """sbatch refusing (an unknown partition, an unreachable slurmctld): one line with what SLURM said."""
    import io

    from submitit.core.utils import FailedJobError

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr; the one line says it
            yield
    except FailedJobError as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        said = [line.split("error:", 1)[1].strip() for line in lines if "error:" in line] or lines[-1:]
        raise SlurmError(f"sbatch refused the job: {'; '.join(said)}") from None


def _threads_from_slurm() -> int:
    import torch

    threads = int(os.environ.get("SLURM_CPUS_PER_TASK", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


@contextlib.contextmanager
def _requeue_when_stopped() -> Iterator[None]:
    """In a one-process job: the pre-emption signal stops training after its step (checkpointed), then submitit's
    own handler runs as if the signal had just come (it calls ``checkpoint`` and requeues the job)."""
    from lapheads.distributed import Interrupted, stop_signals

    usr = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
    submitits = signal.getsignal(usr)
    with stop_signals(signal.SIGINT, usr):
        try:
            yield
        except Interrupted as stopped:
            log.info(f"lapheads: {stopped}; handing the job to submitit to requeue")
            if callable(submitits):
                submitits(usr, None)  # requeues and exits; returns only where it cannot requeue
            raise


class _Requeueable:
    """submitit calls ``checkpoint`` at pre-emption or the time limit: requeue the same call (it resumes the run
    directory it wrote).

    A job shows lapheads' messages at the verbosity of the command that submitted it (``lapheads sweep`` shows its
    progress and notices): the job's process is not the command, and a library import alone shows warnings only,
    so its log would lose the lines that say where a pre-empted run stopped and resumed."""

    def __init__(self) -> None:
        self.verbosity = get_verbosity()  # read where the job is submitted; pickled with it

    def _show_messages(self) -> None:
        set_verbosity(self.verbosity)

    def checkpoint(self, *args: Any, **kwargs: Any):
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


@dataclass(frozen=True)
class CellJobInput:
    """What every cell job of a sweep receives (pickled by submitit): the sweep, the records folder (absolute: a
    job's working directory is not the sweep's) and the plan as it was read once by ``lapheads sweep``."""

    definition: Any  # lapheads.study.cells.SweepDefinition
    records: Path | None
    plan: Any = None  # lapheads.study.records.Plan


class CellJob(_Requeueable):
    """One sweep cell as a SLURM job: train it (resuming its run directory), then write its record."""

    def __call__(self, cell: Any, job: CellJobInput) -> dict[str, Any]:
        from lapheads.study.cells import CellRecorder, train_cell

        self._show_messages()
        threads = _threads_from_slurm()
        began = time.monotonic()
        with _requeue_when_stopped():
            train_cell(job.definition, cell)
        if job.records is not None:
            CellRecorder(job.records, job.definition, job.plan).write(cell, time.monotonic() - began, threads)
        return {"cell": cell.name, "run_dir": str(cell.run_dir)}


class TrainJob(_Requeueable):
    """A training run as a SLURM job of one or more tasks (one per GPU, or per CPU slot), joined as torchrun would."""

    def __call__(self, task: str, cfg: Any, out: str, resume: bool, preset: str | None) -> dict[str, Any]:
        from submitit.helpers import TorchDistributedEnvironment

        from lapheads.runs.directory import RunDir
        from lapheads.tasks import get_task

        self._show_messages()
        _threads_from_slurm()
        environment = TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        train = get_task(task).train_function()
        resume = resume or RunDir(out).exists()  # a requeued job continues what it wrote
        if environment.world_size > 1:
            return train(cfg, Path(out), resume=resume, preset=preset)
        with _requeue_when_stopped():
            return train(cfg, Path(out), resume=resume, preset=preset)


def job_states(job_ids: list[str]) -> dict[str, str]:
    """SLURM's state of each job, "VANISHED" for one SLURM does not know.

    The controller (squeue, one call for all) is asked first: it is the truth for every job it still holds. The
    accounting database (sacct, one call, read by submitit's parser) answers for jobs the controller has let go
    (MinJobAge after they end), and only then: it learns of a job after the controller, so around a requeue it can
    still hold an end the controller has moved past. That answer is never cached (submitit's shared watcher keeps a
    job's first terminal state for good and never asks again), so a later call sees a requeued run.
    """
    _submitit()  # submitit installed and sbatch on PATH, else its one-line error
    states = _controller_states(job_ids)
    gone = [job_id for job_id in job_ids if job_id not in states]
    if gone:
        from submitit.slurm.slurm import SlurmInfoWatcher

        accounting = SlurmInfoWatcher()  # a fresh one: no state carried over from an earlier call
        for job_id in gone:
            accounting.register_job(job_id)
        accounting.update()
        for job_id in gone:
            state = accounting.get_state(job_id, mode="cache").strip()
            states[job_id] = state.split()[0] if state and state != "UNKNOWN" else "VANISHED"  # "CANCELLED by 0"
    return states


def _controller_states(job_ids: list[str]) -> dict[str, str]:
    """squeue's state of each job the controller holds (``-t all``: one that just ended is listed only with it;
    ``-r``: an array's pending tasks one per line). squeue (22.05) lists the ones it holds of several ids but
    refuses a call whose one id it does not hold; should a call of several be refused, each job is asked alone."""
    import subprocess

    def ask(ids: list[str]) -> subprocess.CompletedProcess:
        command = ["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T", "-j", ",".join(ids)]
        return subprocess.run(command, capture_output=True, text=True)

    if not job_ids:
        return {}
    answers = [ask(job_ids)]
    if answers[0].returncode != 0 and len(job_ids) > 1:
        answers = [ask([job_id]) for job_id in job_ids]
    wanted, listed = set(job_ids), {}
    for answer in answers:
        for line in answer.stdout.splitlines():
            job_id, _, state = line.strip().partition("|")
            if job_id in wanted and state:
                listed[job_id] = state.split()[0]
    return listed


def log_tail(folder: Path, job_id: str, lines: int = 5) -> str:
    """The last lines of a job's logs (stderr, else stdout), joined into one line."""
    for name in (f"{job_id}_0_log.err", f"{job_id}_0_log.out"):
        path = folder / job_id / name
        if path.is_file():
            kept = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
            if kept:
                return " | ".join(kept[-lines:])
    return f"(no log in {folder / job_id})"


def submit_cells(
    cells: list[Any], ledger: dict[str, dict[str, Any]], folder: Path, options: SlurmOptions, job: CellJobInput,
    pins: dict[str, str], log,
) -> list[tuple[Any, Any]]:  # fmt: skip
    """Submit ``cells`` that no job holds now as one job array; returns (cell, job) for every cell with a live job
    (new or still queued/running). ``ledger`` (sweep.json's cells) gains each new job id."""
    submitit = _submitit()
    live, todo = [], []
    known = job_states([ledger[c.name]["slurm_job"] for c in cells if ledger[c.name].get("slurm_job")])
    for cell in cells:
        job_id = ledger[cell.name].get("slurm_job")
        if job_id:
            state = known[job_id]
            if state in ACTIVE_STATES:
                log(f"sweep: {cell.name} is {state} as SLURM job {job_id}; not submitted again")
                ledger[cell.name]["status"] = state.lower()
                live.append((cell, submitit.SlurmJob(folder=str(folder / "%j"), job_id=job_id)))
                continue
            log(f"sweep: {cell.name}'s SLURM job {job_id} ended {state}: {log_tail(folder, job_id)}; resubmitting it")
        todo.append(cell)
    if todo:
        executor = _executor(folder, options, f"lapheads-{Path(job.definition.preset).stem}", pins, 1, 1)
        with _refusals(), executor.batch():  # each cell with its run directory absolute, its config resolved here
            jobs = [executor.submit(CellJob(), replace(c, run_dir=Path(c.run_dir).resolve()), job) for c in todo]
        for cell, submitted in zip(todo, jobs):
            ledger[cell.name].update(status="submitted", slurm_job=submitted.job_id)
            log(f"sweep: {cell.name} submitted as SLURM job {submitted.job_id} (log {folder / submitted.job_id})")
            live.append((cell, submitted))
    return live


def wait_for(live: list[tuple[Any, Any]], ledger: dict[str, dict[str, Any]], folder: Path, save, log) -> list[str]:
    """Wait until every job is over; returns "<cell> (job <id> <state>: <log lines>)" for each that did not finish."""
    from lapheads.runs.directory import RunDir

    failed = []
    pending = list(live)
    unknown: dict[str, int] = {}  # rounds each job has been VANISHED
    while pending:
        time.sleep(min(60, 2 + len(pending)))  # one sacct call a round, rarer with more jobs
        states = job_states([job.job_id for _, job in pending])
        for cell, job in list(pending):
            state = states[job.job_id]
            if state in ACTIVE_STATES:
                continue
            finished = RunDir(cell.run_dir).finished()
            if state == "VANISHED" and not finished:
                # neither sacct nor squeue knows it this round (the accounting daemon lags the controller): ask again
                unknown[job.job_id] = unknown.get(job.job_id, 0) + 1
                if unknown[job.job_id] < VANISHED_ROUNDS:
                    continue
            pending.remove((cell, job))
            # a job SLURM has lost track of whose run finished did its work: the run directory is the truth
            done = state in ("COMPLETED", "VANISHED") and finished
            ledger[cell.name]["status"] = "done" if done else "failed"
            save()
            if done:
                log(f"sweep: {cell.name} finished (SLURM job {job.job_id})")
            else:
                failed.append(f"{cell.name} (job {job.job_id} {state}: {log_tail(folder, job.job_id)})")
    return failed


def submit_training(task: str, cfg: Any, out: Path, resume: bool, preset: str | None, options: SlurmOptions,
                    pins: dict[str, str]):  # fmt: skip
    """Submit one training run; returns the submitit job (its logs in ``out``/slurm/<job id>)."""
    executor = _executor(out / "slurm", options, f"lapheads-{task}", pins, options.tasks(), options.nodes)
    with _refusals():
        return executor.submit(TrainJob(), task, cfg, str(Path(out).resolve()), resume, preset)
