"""How a SLURM sweep reads its jobs' ends (lapheads.study.slurm.wait_for), with SLURM's answers scripted: the
accounting daemon learns of a job after the controller, so a job can be unknown to both for a moment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lapheads.runs.directory import RunDir
from lapheads.study import slurm


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """wait_for over cells whose SLURM states follow a script (one list per job, one state a round; the last one
    repeats) and whose run directories are finished or not as given."""

    def run(script: dict[str, list[str]], finished: set[str]):
        rounds = {job: iter(states) for job, states in script.items()}
        last: dict[str, str] = {}

        def job_states(ids):
            for job in ids:
                last[job] = next(rounds[job], last.get(job))
            return {job: last[job] for job in ids}

        monkeypatch.setattr(slurm, "job_states", job_states)
        monkeypatch.setattr(slurm.time, "sleep", lambda seconds: None)
        monkeypatch.setattr(RunDir, "finished", lambda self: self.path.name in finished)
        live = [(SimpleNamespace(name=job, run_dir=tmp_path / job), SimpleNamespace(job_id=job)) for job in script]
        ledger = {job: {} for job in script}
        failed = slurm.wait_for(live, ledger, tmp_path, lambda: None, lambda line: None)
        return failed, {job: entry["status"] for job, entry in ledger.items()}

    return run


def test_a_job_unknown_for_a_round_is_asked_again_not_failed(scripted):
    failed, status = scripted({"12_0": ["RUNNING", "VANISHED", "VANISHED", "COMPLETED"]}, finished={"12_0"})
    assert failed == [] and status == {"12_0": "done"}


def test_a_job_slurm_lost_whose_run_finished_did_its_work(scripted):
    failed, status = scripted({"12_0": ["VANISHED"]}, finished={"12_0"})
    assert failed == [] and status == {"12_0": "done"}


def test_a_job_lost_with_its_run_unfinished_fails_after_the_grace_rounds(scripted):
    failed, status = scripted({"12_0": ["VANISHED"], "12_1": ["RUNNING", "COMPLETED"]}, finished={"12_1"})
    assert status == {"12_0": "failed", "12_1": "done"}
    assert len(failed) == 1 and failed[0].startswith("12_0 (job 12_0 VANISHED: ")


def test_a_completed_job_whose_run_did_not_finish_failed(scripted):
    failed, status = scripted({"12_0": ["COMPLETED"]}, finished=set())
    assert status == {"12_0": "failed"} and failed[0].startswith("12_0 (job 12_0 COMPLETED")


@pytest.fixture
def answers(monkeypatch):
    """job_states over scripted daemons: ``controller`` is what squeue lists (as squeue 22.05 does: of several ids
    the ones it holds, and a call whose one id it does not hold is refused; with ``refuse_several`` any call naming
    such an id is refused), ``accounting`` what sacct lists."""
    submitit = pytest.importorskip("submitit")
    import subprocess

    scripted = SimpleNamespace(controller={}, accounting={}, calls=[], refuse_several=False)

    def squeue(command, **kwargs):
        ids = command[command.index("-j") + 1].split(",")
        scripted.calls.append(ids)
        unknown = [job for job in ids if job not in scripted.controller]
        if unknown and (len(ids) == 1 or scripted.refuse_several):
            return subprocess.CompletedProcess(command, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
        listed = "".join(f"{job}|{scripted.controller[job]}\n" for job in ids if job not in unknown)
        return subprocess.CompletedProcess(command, 0, listed, "")

    def sacct(command, **kwargs):
        asked = {command[i + 1] for i, word in enumerate(command) if word == "-j"}  # an array's id: all its tasks
        rows = [f"{job}|{state}|vm" for job, state in scripted.accounting.items() if job.split("_")[0] in asked]
        return "\n".join(["JobID|State|NodeList", *rows]).encode()

    monkeypatch.setattr(slurm, "_submitit", lambda: submitit)
    monkeypatch.setattr(subprocess, "run", squeue)
    monkeypatch.setattr(submitit.slurm.slurm.subprocess, "check_output", sacct)
    return scripted


def test_the_controller_outranks_the_accounting_databases_stale_end_of_a_requeued_job(answers):
    # around a requeue sacct can still hold an end the controller has moved past
    answers.controller.update({"22": "RUNNING"})
    answers.accounting.update({"22": "FAILED"})
    assert slurm.job_states(["22"]) == {"22": "RUNNING"}
    answers.controller["22"] = "COMPLETED"
    assert slurm.job_states(["22"]) == {"22": "COMPLETED"}


@pytest.mark.parametrize("refuse_several", [False, True])
def test_jobs_the_controller_let_go_are_read_from_sacct_each_call_afresh(answers, refuse_several):
    answers.refuse_several = refuse_several
    answers.controller.update({"30_0": "PENDING"})
    answers.accounting.update({"30_1": "CANCELLED by 0", "30_2": "FAILED"})
    states = slurm.job_states(["30_0", "30_1", "30_2", "31"])
    assert states == {"30_0": "PENDING", "30_1": "CANCELLED", "30_2": "FAILED", "31": "VANISHED"}
    assert answers.calls[0] == ["30_0", "30_1", "30_2", "31"] and len(answers.calls) == (5 if refuse_several else 1)
    answers.accounting["30_2"] = "COMPLETED"  # not the first answer, cached (submitit's shared watcher would)
    assert slurm.job_states(["30_2"])["30_2"] == "COMPLETED"
