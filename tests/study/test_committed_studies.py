"""The studies committed under docs/reproduction/: every plan loads, and every record beside it is a finished cell
of that plan, made under it (its sha256), in the precision it pins; what a reader of a committed report relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lapheads.runs.records import load_records
from lapheads.study.records import check_record, load_plan
from lapheads.study.recordset import RecordSet

STUDIES = Path(__file__).resolve().parents[2] / "docs" / "reproduction"
PLANS = sorted(STUDIES.glob("**/plan.json"))


def test_the_decomposition_study_is_committed_with_its_plan():
    assert STUDIES / "decomposition" / "cells" / "plan.json" in PLANS


@pytest.mark.parametrize("plan_path", PLANS, ids=lambda p: str(p.parent.relative_to(STUDIES)))
def test_every_record_is_a_cell_of_its_folders_plan(plan_path):
    plan = load_plan(plan_path)
    for record in load_records(plan_path.parent):
        check_record(record, plan)  # made under this plan (its sha256 stamped in the record)
        data = record.data
        cell = data["cell"]
        assert record.path.stem == cell["name"] and cell["spec"] in plan.arms and cell["seed"] in plan.seeds
        assert data["sweep"]["preset"] == plan.preset and data["sweep"]["task"] == plan.task
        assert data["sweep_arms"] == {"specs": plan.arms, "seeds": plan.seeds}
        assert not data["environment"].get("git_uncommitted"), record.path.name  # trained by a commit
        if "amp=false" in plan.overrides:  # the plan pins fp32
            assert data["environment"]["precision"]["autocast_bf16"] is False, record.path.name
        gpu = data["environment"].get("accelerator")
        if "device=cuda" in plan.overrides:  # the plan pins a GPU: each record names it
            assert gpu, record.path.name
        if gpu and "amp=false" in plan.overrides:  # fp32 on a GPU is IEEE fp32 (no TF32 matmuls or convolutions)
            assert gpu["fp32_matmul"] == gpu["fp32_conv"] == "ieee", record.path.name
        # finished: its log reaches the run's last step (wall_seconds is None where a later sweep recorded it)
        last = max((entry["step"] for entry in data["metrics"] if "step" in entry), default=None)
        assert last == data["config"]["steps"], f"{record.path.name} is not a finished cell"
        assert data["wall_seconds"] is None or data["wall_seconds"] > 0


@pytest.mark.parametrize("plan_path", PLANS, ids=lambda p: str(p.parent.relative_to(STUDIES)))
def test_each_seeds_arms_share_one_environment(plan_path):
    """A seed's arms are compared with each other, so they ran in one environment (torch, kernels, threads,
    precision, GPU): the rule every plan here states, so the report leaves no committed seed out."""
    if load_records(plan_path.parent):
        assert RecordSet.from_folder(plan_path.parent).mixed_environments == {}


@pytest.mark.parametrize("plan_path", PLANS, ids=lambda p: str(p.parent.relative_to(STUDIES)))
def test_a_committed_report_tests_the_margins_its_plan_fixed(plan_path):
    """A record-based report is judged under its own plan: its sha256, and each margin the plan fixed before the
    data (not the paper's default recomputed on the study's baseline, which moves with the data)."""
    reports = sorted(plan_path.parent.glob("report*/stats.json"))  # report/, or report-vs-<arm>/ with --baseline
    if not reports:
        pytest.skip("no report yet: the study has not reached its stop")
    plan, rule = load_plan(plan_path), json.loads(reports[0].read_text())["rule"]
    assert rule["plan"]["sha256"] == plan.sha256
    for label, margin in plan.margins.items():
        assert rule["margin"][label] == margin, label


REPORTS = sorted(STUDIES.glob("**/cells/report*/stats.json"))  # report-vs-<arm>/: built with --baseline
#: the appendix's sweeps from before records existed: a stats.json each, restated once into its verdicts.md
RESTATED = sorted(p.parent for p in STUDIES.glob("*/verdicts.md"))


def _rows(saved: dict) -> dict:
    return {**saved["metrics"], **saved.get("geometry", {})}


@pytest.mark.parametrize("stats_file", REPORTS, ids=lambda p: str(p.parents[2].relative_to(STUDIES)))
def test_restating_a_committed_report_gives_its_verdicts(stats_file):
    """Issue 76 (red team, high): `lapheads report RECORDS/report/stats.json` said "no plan was declared", made test
    top-1 the primary and showed a contrast row ("sum:1 vs 1") as that arm against k = 0. Restated, every report
    is judged under the plan it names, with its primary, and each row's verdict and difference are the report's."""
    from lapheads.study.report import restated

    saved = json.loads(stats_file.read_text())
    rule, table, _, _ = restated(stats_file)
    assert rule["plan"] == saved["rule"]["plan"] and rule["primary"] == saved["rule"]["primary"]
    assert rule["declaration"] == saved["rule"]["declaration"]
    for label, rows in _rows(saved).items():
        for key, row in rows.items():
            again = table[label][key]
            assert again.verdict == row.get("verdict"), (label, key)
            if row.get("paired"):
                assert again.paired["mean_difference"] == pytest.approx(row["paired"]["mean_difference"], abs=1e-12)


@pytest.mark.parametrize("folder", RESTATED, ids=lambda p: p.name)
def test_an_appendix_stats_json_restates_to_its_committed_verdicts_byte_for_byte(folder):
    from lapheads.study.report import restate

    assert restate(folder / "stats.json") + "\n" == (folder / "verdicts.md").read_text()


def test_a_report_restated_away_from_its_plan_is_refused_not_read_without_it(tmp_path):
    from lapheads.cli import main

    copy = tmp_path / "stats.json"
    copy.write_bytes((STUDIES / "decomposition" / "cells" / "report" / "stats.json").read_bytes())
    assert main(["report", str(copy)]) == 2


#: the arguments docs/reproduction.md gives each report's rebuild (patch 4 stopped by its rule at seed 5; stage B's
#: plan and the tuned intervention's read them against k = 0 at its own lr)
REBUILD_ARGS = {
    "patch4": ["--seeds", "0,1,2,3,4,5"],
    "best-lr": ["--baseline", "0+lr=1.2e-2"],
    "intervention-tuned": ["--baseline", "0+lr=1.2e-2"],
}


@pytest.mark.parametrize("stats_file", REPORTS, ids=lambda p: str(p.parents[2].relative_to(STUDIES)))
def test_rebuilding_a_committed_report_from_its_records_is_byte_identical(stats_file, tmp_path):
    """Issue 76: the account's rebuild commands rewrote five of six committed reports (wording, a code-revisions
    block), so a reader who followed them got a dirty tree. Rebuilt from a copy of the records folder, every file
    of the report is the committed one, byte for byte."""
    import shutil

    from lapheads.cli import main

    folder = stats_file.parents[1]
    copy = tmp_path / "cells"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("report*"))
    study = str(folder.parent.relative_to(STUDIES))
    assert main(["report", str(copy), *REBUILD_ARGS.get(study, [])]) == 0
    rebuilt = copy / stats_file.parent.name
    committed = sorted(p.name for p in stats_file.parent.iterdir())
    assert sorted(p.name for p in rebuilt.iterdir()) == committed
    for name in committed:
        assert (rebuilt / name).read_bytes() == (stats_file.parent / name).read_bytes(), name
