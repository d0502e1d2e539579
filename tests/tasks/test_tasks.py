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
    assert all(source == "metrics" or source.endswith(".json") for _, source, _ in task.headline)


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
    """report's "still improving" reads a metric's better direction from LOWER_IS_BETTER: a new task's loss must be
    listed there, or its falling loss would read as getting worse."""
    from lapheads.tasks import TASKS
    from lapheads.tasks.metrics import LOWER_IS_BETTER

    for task in TASKS.values():
        for label, _, _ in task.headline:
            if any(word in label for word in ("loss", "bits per byte", "perplexity")):
                assert label in LOWER_IS_BETTER, (task.name, label)


def test_the_tasks_a_run_may_name_are_the_task_tables():
    """runs/ sits below the task table, so its loaders check a record's task against RUN_TASKS: the same names."""
    from lapheads.runs.layout import RUN_TASKS
    from lapheads.tasks import TASKS

    assert set(RUN_TASKS) == set(TASKS) and len(RUN_TASKS) == len(TASKS)
