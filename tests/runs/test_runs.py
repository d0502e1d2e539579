"""The run-directory contract (lapheads.runs): the model rebuilds from config.json alone, the readers' helpers, and
run directories written before the model was recorded (one-line error, then ``lapheads upgrade``)."""

import dataclasses
import json

import pytest
import torch

from lapheads.cli import main
from lapheads.errors import CheckpointError, InputError
from lapheads.runs import RunDir, SweepError, load_gpt_run, load_model, load_sweep
from lapheads.train.classify import train_classify
from lapheads.train.configs.classify import build_model
from lapheads.train.configs.dino import build_backbone
from lapheads.train.dino import train_dino
from lapheads.train.lm import train_lm
from tests.conftest import tiny_classify, tiny_lm


@pytest.fixture(scope="module")
def classify_run(fmnist_root, tmp_path_factory):
    cfg = tiny_classify(fmnist_root, epochs=0.25, ema_decay=0.9, layer_scale=1e-6)
    run = tmp_path_factory.mktemp("runs") / "classify"
    train_classify(cfg, run)
    return run, cfg


def _forward(model, x):
    with torch.no_grad():
        return model(x)


def test_a_classify_run_rebuilds_from_its_record_alone(classify_run):
    run, cfg = classify_run
    record = json.loads((run / "config.json").read_text())
    assert record["model"]["factory"] == "vit" and record["model"]["kwargs"]["init_values"] == 1e-6
    # the same weights through the training-side builder and through the record
    reference = build_model(cfg, record["num_classes"], record["in_chans"])
    from lapheads.runs import checkpoint_folder, load_weights

    load_weights(reference, checkpoint_folder(RunDir(run)) / "model.safetensors")
    model = load_model(run)
    assert not model.training
    x = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(_forward(model, x), _forward(reference.eval(), x), rtol=0, atol=0)
    ema = load_model(run, "ema")
    assert not torch.equal(_forward(ema, x), _forward(model, x))


def test_load_model_refuses_weights_the_run_does_not_have(classify_run):
    run, _ = classify_run
    with pytest.raises(
        CheckpointError, match="teacher.safetensors does not exist; allowed weights of this run: model, ema"
    ):
        load_model(run, "teacher")
    with pytest.raises(InputError, match="weights 'student'; allowed: model, ema, teacher"):
        load_model(run, "student")
    with pytest.raises(CheckpointError, match="no checkpoint of step 7; allowed: "):
        load_model(run, step=7)


def test_readers_helpers(classify_run, tmp_path):
    run = RunDir(classify_run[0])
    assert run.finished() and run.task("classify") == "classify"
    assert run.last_metric("eval_top1") == [r for r in run.read_metrics() if "eval_top1" in r][-1]["eval_top1"]
    assert run.last_metric("no_such_metric") is None
    assert run.settings().laplacian_heads == "1"
    with pytest.raises(
        CheckpointError, match="holds a 'classify' run, whose model is a 'vit'; allowed here: a GPT's run"
    ):
        load_gpt_run(run.path)
    other = RunDir(tmp_path / "other")
    assert not other.exists() and not other.finished() and other.read_report("x.json") is None
    other.write_report("x.json", {"a": 1})
    assert other.read_report("x.json") == {"a": 1}
    (other.report_dir / "x.json").write_text("{")
    with pytest.raises(CheckpointError, match="x.json is corrupt .*delete it to measure again"):
        other.read_report("x.json")
    with pytest.raises(SweepError, match="holds no sweep"):
        load_sweep(tmp_path)


def test_an_old_run_fails_in_one_line_and_upgrade_converts_it(classify_run, tmp_path, capsys):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(classify_run[0], old)
    record = json.loads((old / "config.json").read_text())
    record.pop("model")  # as lapheads wrote classify runs before the model was recorded
    (old / "config.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=f"written before .* convert it with: lapheads upgrade {old}"):
        load_model(old)
    assert main(["upgrade", str(old)]) == 0
    assert "added model" in capsys.readouterr().out
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(_forward(load_model(old), x), _forward(load_model(classify_run[0]), x))
    assert main(["upgrade", str(old)]) == 0 and "already current" in capsys.readouterr().out


def test_dino_and_lm_runs_rebuild_from_their_records(tiny_dino, text_root, tmp_path):
    train_dino(dataclasses.replace(tiny_dino, epochs=1), tmp_path / "dino")
    teacher = load_model(tmp_path / "dino", "teacher")
    student = load_model(tmp_path / "dino", "model")
    x = torch.randn(2, 1, 28, 28)
    assert _forward(teacher, x).shape == (2, 32) and not torch.equal(_forward(teacher, x), _forward(student, x))
    fresh = build_backbone(tiny_dino, 1)
    assert set(fresh.state_dict()) == set(teacher.state_dict())

    train_lm(tiny_lm(text_root, num_iterations=2, eval_every=2), tmp_path / "lm")
    record, model, tokenizer = load_gpt_run(tmp_path / "lm", "cpu")
    assert record["model"]["factory"] == "gpt" and model.laplacian_masks() == record["laplacian_masks"]
    ids = torch.tensor([tokenizer.encode("ROMEO:", bos=True)])
    assert _forward(model, ids).shape[-1] == model.config.vocab_size
    # an lm run from before: the model record and the token folder come back from its training config
    config = json.loads((tmp_path / "lm" / "config.json").read_text())
    (tmp_path / "lm" / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k not in ("model", "tokens")})
    )
    from lapheads.tasks import upgrade_run

    assert upgrade_run(tmp_path / "lm") == ["model", "tokens"]
    assert json.loads((tmp_path / "lm" / "config.json").read_text()) == config


def test_a_record_says_when_its_code_was_not_a_commit(monkeypatch):
    """Issue 76 (red team, medium): a record trained from a checkout with uncommitted changes named the clean commit.
    Its environment lists the package's changed paths ([] clean, None where git cannot tell), and a report lists
    such a cell under "<revision>+uncommitted"."""
    import subprocess
    from types import SimpleNamespace

    from lapheads.runs import directory
    from lapheads.study.report import statistics

    real = directory.uncommitted_changes()
    assert real is None or isinstance(real, list)
    porcelain = " M src/lapheads/core/attention.py\n?? src/lapheads/new.py\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stdout=porcelain))
    assert directory.uncommitted_changes() == ["src/lapheads/core/attention.py", "src/lapheads/new.py"]
    many = "".join(f" M src/lapheads/f{i:02d}.py\n" for i in range(25))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stdout=many))
    assert directory.uncommitted_changes()[-1] == "... and 5 more"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=128, stdout=""))
    assert directory.uncommitted_changes() is None  # not a checkout: unknown, not clean

    def cell(name, uncommitted):
        env = {"git_revision": "a" * 40, "git_uncommitted": uncommitted}
        return SimpleNamespace(name=name, data={"environment": env})

    cells = (cell("L0-s0", []), cell("L3-s0", ["src/lapheads/x.py"]), cell("L1-s0", None))
    revisions = statistics.code_revisions(SimpleNamespace(cells=cells))  # a RecordSet's cells are all it reads
    assert revisions == {"a" * 40: ["L0-s0", "L1-s0"], "a" * 40 + "+uncommitted": ["L3-s0"]}


def test_the_git_revision_is_read_without_git_too(monkeypatch, tmp_path):
    # a GPU container given a copy of the checkout may have no git: the record still names the commit
    import subprocess

    from lapheads.runs import directory

    with_git = directory.git_revision()
    if with_git is None:
        pytest.skip("not run from a git checkout")

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert directory.git_revision() == with_git
    # a branch whose ref was packed (git gc) is read from packed-refs; a folder with no .git above it has none
    git = tmp_path / "repo" / ".git"
    git.mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text(
        f"# pack-refs with: peeled\n{'a' * 40} refs/heads/other\n{'b' * 40} refs/heads/main\n"
    )
    assert directory._revision_from_files(tmp_path / "repo" / "src") == "b" * 40
    assert directory._revision_from_files(tmp_path) is None
    # a worktree (`git worktree add`, how a study's frozen tree is kept): a .git file naming its folder in the repo
    worktree = git / "worktrees" / "frozen"
    worktree.mkdir(parents=True)
    (worktree / "commondir").write_text("../..\n")
    (worktree / "HEAD").write_text(f"{'c' * 40}\n")  # detached at the frozen commit
    (tmp_path / "frozen").mkdir()
    (tmp_path / "frozen" / ".git").write_text(f"gitdir: {worktree}\n")
    assert directory._revision_from_files(tmp_path / "frozen") == "c" * 40
    (worktree / "HEAD").write_text("ref: refs/heads/main\n")  # on a branch: its ref is in the main repository
    assert directory._revision_from_files(tmp_path / "frozen") == "b" * 40
