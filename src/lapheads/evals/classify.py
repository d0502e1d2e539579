"""Classification evaluation: top-1 / top-5 / cross-entropy of a model on a split (summed across torchrun ranks), and
``lapheads eval classify RUN_DIR`` on a run's latest checkpoint (rebuilt by ``lapheads.runs.load_model``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from lapheads.data.images import build_image_data
from lapheads.distributed import Distributed, setup_distributed
from lapheads.runs import RunDir, checkpoint_folder, load_model

__all__ = ["evaluate_classifier", "evaluate_run"]


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


def evaluate_run(run_dir: Path, use_ema: bool = False) -> dict[str, Any]:
    """Evaluate the latest checkpoint of a classification run directory on its eval split."""
    run = RunDir(run_dir)
    run.task("classify")
    cfg = run.read_config()["config"]
    dist_ = setup_distributed(cfg["device"])
    model = load_model(run, "ema" if use_ema else "model", device=dist_.device)
    data = build_image_data(cfg["dataset"], cfg["data_root"], cfg["img_size"])
    eval_set = (
        data.eval if cfg["eval_subset"] is None else Subset(data.eval, range(min(cfg["eval_subset"], len(data.eval))))
    )
    metrics = evaluate_classifier(model, eval_set, dist_, 256, cfg["amp"], cfg["num_workers"])
    return {"run_dir": str(run.path), "checkpoint": checkpoint_folder(run).name, **metrics}
