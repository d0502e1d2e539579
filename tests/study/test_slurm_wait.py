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
