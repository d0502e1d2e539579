"""Classification evaluation: top-1 / top-5 / cross-entropy of a model on a split (summed across torchrun ranks), and
``lapheads eval classify RUN_DIR`` on a run's latest checkpoint (rebuilt by ``lapheads.runs.load_model``).

The fit score is the same evaluation on the run's own training images with the evaluation transform (no
augmentation): next to the test score it says whether a model is underfit (fit about equal to test) or has fitted
its training data (fit well above test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from lapheads.data.images import build_image_data
from lapheads.distributed import Distributed, setup_distributed
from lapheads.errors import InputError
from lapheads.evals.options import ClassifyEvalOptions
from lapheads.hardware import choose_precision
from lapheads.runs import RunDir, checkpoint_folder, load_model

__all__ = ["evaluate", "evaluate_classifier", "evaluate_fit", "evaluate_run", "fit_images"]


@torch.no_grad()
def evaluate_classifier(
    model: torch.nn.Module, dataset, dist_: Distributed, batch_size: int, amp: bool, num_workers: int = 0
) -> dict[str, float]:
    """Top-1 / top-5 accuracy and mean cross-entropy over ``dataset``, summed across ranks."""
    model.eval()
    shard = Subset(dataset, range(dist_.rank, len(dataset), dist_.world_size))
    loader = DataLoader(shard, batch_size=batch_size, num_workers=num_workers)
    totals = torch.zeros(4, dtype=torch.float64, device=dist_.device)
    for images, labels in loader:
        images, labels = images.to(dist_.device), labels.to(dist_.device)
        with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(images)
        logits = logits.float()
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        totals += torch.stack(
            [
                (top5[:, 0] == labels).sum(),
                (top5 == labels[:, None]).any(1).sum(),
                F.cross_entropy(logits, labels, reduction="sum"),
                torch.tensor(len(labels), device=dist_.device),
            ]
        ).to(totals)
    dist_.all_reduce_sum(totals)
    model.train()
    n = max(totals[3].item(), 1)
    return {
        "eval_top1": 100 * totals[0].item() / n,
        "eval_top5": 100 * totals[1].item() / n,
        "eval_loss": totals[2].item() / n,
    }


def fit_images(dataset: str, data_root: str | None, img_size: int, n: int, train_subset: int | None) -> Subset:
    """The first ``n`` images of a run's training set (capped at its ``train_subset``) with the eval transform."""
    clean = build_image_data(dataset, data_root, img_size, augment=False).train
    return Subset(clean, range(min(n, train_subset or len(clean), len(clean))))


def evaluate_fit(
    model: torch.nn.Module, images: Subset, dist_: Distributed, batch_size: int, amp: bool, num_workers: int = 0
) -> dict[str, float]:
    """fit_top1 / fit_loss: ``evaluate_classifier`` on training images (``fit_images``)."""
    scores = evaluate_classifier(model, images, dist_, batch_size, amp, num_workers)
    return {"fit_top1": scores["eval_top1"], "fit_loss": scores["eval_loss"]}


def evaluate_run(run_dir: Path, use_ema: bool = False, fit_subset: int | None = None) -> dict[str, Any]:
    """Evaluate the latest checkpoint of a classification run directory on its eval split (and, with
    ``fit_subset``, on that many of its training images without augmentation)."""
    if fit_subset is not None and fit_subset < 1:
        raise InputError(f"--fit-subset {fit_subset}; allowed: a positive number of training images")
    run = RunDir(run_dir)
    run.task("classify")
    cfg = run.read_config()["config"]
    dist_ = setup_distributed(cfg["device"])
    model = load_model(run, "ema" if use_ema else "model", device=dist_.device)
    data = build_image_data(cfg["dataset"], cfg["data_root"], cfg["img_size"])
    eval_set = (
        data.eval if cfg["eval_subset"] is None else Subset(data.eval, range(min(cfg["eval_subset"], len(data.eval))))
    )
    autocast = choose_precision(
        cfg["amp"], dist_.device
    ).autocast  # this machine's choice: evaluation is not a trajectory
    metrics = evaluate_classifier(model, eval_set, dist_, 256, autocast, cfg["num_workers"])
    if fit_subset:
        images = fit_images(cfg["dataset"], cfg["data_root"], cfg["img_size"], fit_subset, cfg["train_subset"])
        metrics.update(evaluate_fit(model, images, dist_, 256, autocast, cfg["num_workers"]))
    return {"run_dir": str(run.path), "checkpoint": checkpoint_folder(run).name, **metrics}


def evaluate(options: ClassifyEvalOptions) -> dict[str, Any]:
    """``lapheads eval classify RUN_DIR``: the checkpoint's top-1 / top-5 (and its fit on training images)."""
    return evaluate_run(Path(options.run_dir), use_ema=options.ema, fit_subset=options.fit_subset)
