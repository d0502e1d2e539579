"""The task table: every entry resolves, and the CLI, presets, sweeps and reports read it."""

import dataclasses

import pytest

from lapheads.cli import build_parser
from lapheads.config import validate_config
from lapheads.errors import InputError, LapheadsError
from lapheads.tasks import TASKS, get_task
from lapheads.tasks.presets import CONFIG_TYPES, PRESETS


@pytest.mark.parametrize("name", list(TASKS))
def test_every_entry_resolves(name):
    task = TASKS[name]
    config_type = task.config_type()
    assert dataclasses.is_dataclass(config_type) and callable(task.train_function())
    presets = task.preset_table()
    assert presets and all(isinstance(cfg, config_type) for cfg in presets.values())
    for cfg in presets.values():
        if not task.from_run:  # mid/sft presets get their --base from --from at run time
            validate_config(cfg)
    assert PRESETS[name] is presets and CONFIG_TYPES[name] is config_type
    for reference in (task.check_model, task.analyzer, task.upgrade):
        if reference is not None:
            from lapheads.tasks import _load

            assert callable(_load(reference))
    assert task.headline, "report needs at least one headline metric"
    assert all(m.source == "metrics" or m.source.endswith(".json") for m in task.headline)


def test_the_cli_offers_exactly_the_tasks():
    parser = build_parser()
    train = next(a for a in parser._subparsers._group_actions[0].choices["train"]._actions if a.dest == "task")
    assert list(train.choices) == list(TASKS)
    assert "--from" in train.choices["sft"].format_help() and "--from" not in train.choices["lm"].format_help()


def test_check_model_fails_in_one_line_for_a_spec_that_does_not_fit():
    task = get_task("classify")
    cfg = dataclasses.replace(PRESETS["classify"]["fmnist-cpu"], laplacian_heads="7")
    with pytest.raises(LapheadsError, match="laplacian_heads=7 is out of range; allowed: 0 to 3"):
        task.check(cfg)
    with pytest.raises(InputError, match="task 'vision'; allowed: classify, lm, dino, mid, sft"):
        get_task("vision")


def test_every_loss_like_headline_metric_is_known_to_improve_by_falling():
    """report's "still improving" reads a metric's better direction from its Metric: a new task's loss must say
    lower_is_better, or its falling loss would read as getting worse."""
    from lapheads.tasks import TASKS

    for task in TASKS.values():
        for metric in task.headline:
            if any(word in metric.label for word in ("loss", "bits per byte", "perplexity")):
                assert metric.lower_is_better and metric.better == -1, (task.name, metric.label)


def test_the_tasks_a_run_may_name_are_the_task_tables():
    """runs/ sits below the task table, so its loaders check a record's task against RUN_TASKS: the same names."""
    from lapheads.runs.layout import RUN_TASKS
    from lapheads.tasks import TASKS

    assert set(RUN_TASKS) == set(TASKS) and len(RUN_TASKS) == len(TASKS)


def test_a_metric_carries_its_claim_and_direction_and_one_label_names_one_metric():
    """Reports join a row to the paper's claim through its Metric: one label must name one metric everywhere (two
    declarations of a label with different claims would make the verdict depend on which was read)."""
    from lapheads.tasks import TASKS
    from lapheads.tasks.metrics import MECHANISM, METRICS, claim, logged

    declared = [m for t in TASKS.values() for m in (*t.headline, *t.geometry)] + list(MECHANISM)
    for metric in declared:
        assert METRICS[metric.label] == metric
        assert claim(metric.label) == metric.claim
    assert claim("within-sequence fraction (after the final norm)") == -1  # a layer does not change the claim
    assert claim("diffusion score, Laplacian heads (block 3)") == +1
    assert claim("diffusion score, ordinary heads (mean over blocks)") is None
    # report --metric KEY: a declared metric logged under KEY keeps its claim and direction, under the key's label
    bpb = logged("val_bpb")
    assert (bpb.label, bpb.claim, bpb.better) == ("val_bpb", -1, -1)
    other = logged("fit_loss")
    assert (other.claim, other.better, other.path) == (None, +1, ("fit_loss",))


TRAINERS = ("lapheads.train.classify", "lapheads.train.lm", "lapheads.train.dino", "lapheads.train.chat")


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "classify", "--help"],
        ["train", "lm", "--help"],
        ["sweep", "fmnist-cpu", "--laplacian-heads", "0,1", "--seeds", "0", "--dry-run", "--out", "{tmp}/s"],
        ["sweep", "shakespeare-cpu", "--laplacian-heads", "0", "--seeds", "0", "--dry-run", "--out", "{tmp}/l"],
    ],
)
def test_reading_the_task_table_imports_no_trainer(argv, tmp_path):
    """The task table's promise (issue 59): presets, ``--help`` and a sweep's dry run read configs
    (lapheads.train.configs), never a trainer module."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom lapheads.cli import main\n"
        f"try:\n    main({[a.replace('{tmp}', str(tmp_path)) for a in argv]!r})\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in sys.modules if m in {TRAINERS!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
