"""``lapheads eval dino``: k-NN, linear and segmentation probes on a DINO run's teacher, and its pictures.

Design choices:

* **The teacher backbone is evaluated** (DINO's ``checkpoint_key teacher``), frozen, on evaluation transforms.
* **Features**: the final CLS token (after the last norm) for k-NN; the CLS tokens of the last 4 blocks, each after
  the final norm, concatenated, for the linear probe (DINO's ViT-S protocol); the final patch tokens as a grid for
  segmentation and PCA.
* **Segmentation data**: composite Fashion-MNIST scenes for Fashion-MNIST runs (training scenes from training
  items, test scenes from test items), ADE20K (``--ade20k ROOT``) otherwise.
* **Pictures**: CLS-to-patch attention maps of the last block, per head, from the reference path (maps of P; a
  Laplacian head outputs V - PV, so its map is marked); PCA pictures (first component thresholded for foreground,
  a second PCA on the foreground patches, 3 components min-max scaled to RGB), one grid of images x runs.
* **The PCA pictures measured**: on composite scenes the true foreground is known, so the first step of the PCA
  pictures (is the object separated from the background?) is scored as the IoU of the PCA foreground patches with
  the true ones (``pca_foreground_iou``), over all test scenes. Boundary sharpness itself stays a picture.
* **Cached per run**: eval_dino.json records the checkpoint and options; ``reuse=True`` keeps a matching one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from lapheads.evals.options import DinoEvalOptions
from lapheads.evals.probes import knn_accuracy, linear_probe, segmentation_probe
from lapheads.geometry.features import ResidualStream
from lapheads.plots import panel_grid

log = logging.getLogger(__name__)

__all__ = [
    "EVAL_FILE",
    "attention_maps",
    "eval_dino",
    "foreground_iou",
    "load_dino_teacher",
    "pca_foreground",
    "pca_pictures",
]

EVAL_FILE = "eval_dino.json"
EVAL_VERSION = 2  # bump when the probes change, so cached eval_dino.json files are measured again


def load_dino_teacher(run_dir: str | Path, device: str = "auto", step: int | None = None):
    """(config fields as attributes, frozen teacher backbone in eval mode, config.json record) of a DINO run's
    latest checkpoint (or ``step``'s)."""
    from lapheads.runs import RunDir, load_model

    run = RunDir(run_dir)
    run.task("dino")
    return run.settings(), load_model(run, "teacher", step, device), run.read_config()


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def extract_features(
    backbone: torch.nn.Module, dataset, batch_size: int = 256, n_last: int = 4, desc: str = "features"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(final CLS (N, D), last-``n_last``-blocks CLS concatenated (N, n_last * D), labels (N,))."""
    depth = len(backbone.blocks)
    layers = [str(i) for i in range(max(1, depth - n_last + 1), depth + 1)]  # all blocks if fewer than n_last
    cls_final, cls_last, labels = [], [], []
    with ResidualStream(backbone, layers) as stream:
        for images, y in tqdm(DataLoader(dataset, batch_size=batch_size), desc=desc, leave=False, dynamic_ncols=True):
            cls_final.append(backbone(images.to(_device(backbone))).float().cpu())
            cls_last.append(torch.cat([backbone.norm(stream.tokens[n])[:, 0] for n in layers], 1).float().cpu())
            labels.append(torch.as_tensor(y))
    return torch.cat(cls_final), torch.cat(cls_last), torch.cat(labels)


@torch.no_grad()
def patch_grid(backbone: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Final patch tokens (after the last norm) as a (B, D, h, w) grid."""
    tokens = backbone.forward_features(images.to(_device(backbone)))[:, backbone.num_prefix_tokens :]
    h, w = (
        images.shape[-2] // backbone.patch_embed.patch_size[0],
        images.shape[-1] // backbone.patch_embed.patch_size[1],
    )
    return tokens.float().reshape(len(images), h, w, -1).permute(0, 3, 1, 2).cpu()


@torch.no_grad()
def attention_maps(backbone: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """CLS -> patch attention probabilities P of the last block, per head: (B, H, h, w)."""
    depth = len(backbone.blocks)
    before = "embed" if depth == 1 else str(depth - 1)
    with ResidualStream(backbone, [before]) as stream:
        backbone.forward_features(images.to(_device(backbone)))
    last = backbone.blocks[-1]
    _, attn = last.attn.forward_with_attn(last.norm1(stream.tokens[before]))
    h, w = (
        images.shape[-2] // backbone.patch_embed.patch_size[0],
        images.shape[-1] // backbone.patch_embed.patch_size[1],
    )
    return attn[:, :, 0, backbone.num_prefix_tokens :].reshape(len(images), -1, h, w).float().cpu()


def pca_foreground(grid: torch.Tensor) -> torch.Tensor:
    """Foreground patches (B, h, w) of patch grids (B, D, h, w) by DINO's rule: the first principal component over
    all patches of the batch, its sign chosen so that border patches (mostly background) score low, above 0."""
    b, d, h, w = grid.shape
    tokens = grid.permute(0, 2, 3, 1).reshape(-1, d).double()
    centred = tokens - tokens.mean(0)
    score = (centred @ torch.linalg.svd(centred, full_matrices=False)[2][0]).view(b, h, w)
    border = torch.ones(h, w, dtype=torch.bool)
    border[1:-1, 1:-1] = False
    return score < 0 if score[:, border].mean() > 0 else score > 0


def foreground_iou(foreground: torch.Tensor, masks: torch.Tensor) -> float:
    """IoU (%) of predicted foreground patches (B, h, w) with the true foreground of pixel masks (B, H, W), label 0
    = background; a patch is truly foreground when most of its pixels are. Measures the PCA pictures' first step."""
    b, h, w = foreground.shape
    truth = F.adaptive_avg_pool2d((masks > 0).float().unsqueeze(1), (h, w)).squeeze(1) >= 0.5
    union = (truth | foreground).sum().item()
    return 100.0 * (truth & foreground).sum().item() / union if union else 100.0


def pca_pictures(grid: torch.Tensor) -> torch.Tensor:
    """DINO/DINOv2 PCA pictures of patch grids (B, D, h, w) -> RGB (B, h, w, 3) in [0, 1], background black.

    Foreground patches come from ``pca_foreground``; a second PCA on the foreground patches gives 3 components,
    each min-max scaled to a colour channel.
    """
    b, d, h, w = grid.shape
    foreground = pca_foreground(grid)
    rgb = torch.zeros(b, h, w, 3, dtype=torch.float64)
    fg_tokens = grid.permute(0, 2, 3, 1).double()[foreground]
    if len(fg_tokens) >= 3:
        fg_centred = fg_tokens - fg_tokens.mean(0)
        components = fg_centred @ torch.linalg.svd(fg_centred, full_matrices=False)[2][:3].T
        low, high = components.min(0).values, components.max(0).values
        rgb[foreground] = (components - low) / (high - low).clamp_min(1e-12)
    return rgb.float()


def _segmentation_sets(cfg, ade20k: str | None, train_scenes: int, test_scenes: int):
    from lapheads.data.images import load_fashion_mnist
    from lapheads.data.segmentation import ADE20K, CompositeScenes

    if cfg.dataset == "fashion-mnist":
        train_items, test_items = load_fashion_mnist(cfg.data_root, "train"), load_fashion_mnist(cfg.data_root, "test")
        return (
            CompositeScenes(train_items.images, train_items.targets, train_scenes, seed=0),
            CompositeScenes(test_items.images, test_items.targets, test_scenes, seed=1),
            CompositeScenes.num_classes,
        )
    if ade20k:
        train, test = ADE20K(ade20k, "training", cfg.img_size), ADE20K(ade20k, "validation", cfg.img_size)
        return (
            Subset(train, range(min(train_scenes, len(train)))),
            Subset(test, range(min(test_scenes, len(test)))),
            ADE20K.num_classes,
        )
    return None


def _grids(backbone: torch.nn.Module, dataset, batch_size: int, desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    grids, masks = [], []
    for images, m in tqdm(DataLoader(dataset, batch_size=batch_size), desc=desc, leave=False, dynamic_ncols=True):
        grids.append(patch_grid(backbone, images))
        masks.append(m)
    return torch.cat(grids), torch.cat(masks)


def _plot_attention(maps: torch.Tensor, images: torch.Tensor, laplacian: list[bool], title: str, path: Path) -> None:
    rows, heads = maps.shape[0], maps.shape[1]
    with panel_grid(path, rows * (heads + 1), cols=heads + 1, size=(1.6, 1.6), title=title) as axes:
        for r in range(rows):
            row = axes[r * (heads + 1) : (r + 1) * (heads + 1)]
            row[0].imshow(images[r].permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray")
            for hd in range(heads):
                row[hd + 1].imshow(maps[r, hd].numpy(), cmap="inferno")
                if r == 0:
                    row[hd + 1].set_title(f"head {hd}" + (" (Laplacian)" if laplacian[hd] else ""), fontsize=7)
        for ax in axes:
            ax.axis("off")


def _plot_pca(images: torch.Tensor, pictures: dict[str, torch.Tensor], path: Path) -> None:
    rows, cols = len(images), 1 + len(pictures)
    with panel_grid(path, rows * cols, cols=cols, size=(1.8, 1.8)) as axes:
        for r in range(rows):
            row = axes[r * cols : (r + 1) * cols]
            row[0].imshow(images[r].permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray")
            for c, (label, rgb) in enumerate(pictures.items(), start=1):
                row[c].imshow(rgb[r].numpy(), interpolation="nearest")
                if r == 0:
                    row[c].set_title(label, fontsize=8)
        for ax in axes:
            ax.axis("off")


def _probe_run(
    cfg, backbone: torch.nn.Module, record: dict[str, Any], segmentation, options: dict[str, Any]
) -> dict[str, Any]:
    """k-NN (trained and random-init), linear probe, segmentation probe and PCA foreground IoU of one teacher."""
    from lapheads.data.images import build_image_data
    from lapheads.data.segmentation import CompositeScenes
    from lapheads.runs import build_model

    data = build_image_data(cfg.dataset, cfg.data_root, cfg.img_size, augment=False)
    max_train, max_test = options["max_train"], options["max_test"]
    train = data.train if max_train is None else Subset(data.train, range(min(max_train, len(data.train))))
    test = data.eval if max_test is None else Subset(data.eval, range(min(max_test, len(data.eval))))
    train_cls, train_last, train_y = extract_features(backbone, train, desc="train features")
    test_cls, test_last, test_y = extract_features(backbone, test, desc="test features")
    # the same architecture, randomly initialised: what the training added, not what the architecture gives
    torch.manual_seed(cfg.seed)
    untrained = build_model(record["model"]).to(_device(backbone)).eval()
    base_train, _, _ = extract_features(untrained, train, desc="random-init train")
    base_test, _, _ = extract_features(untrained, test, desc="random-init test")
    result: dict[str, Any] = {
        "knn": {
            str(k): v
            for k, v in knn_accuracy(train_cls, train_y, test_cls, test_y, num_classes=data.num_classes).items()
        },
        "knn_random_init": {
            str(k): v
            for k, v in knn_accuracy(base_train, train_y, base_test, test_y, num_classes=data.num_classes).items()
        },
        "linear": linear_probe(
            train_last, train_y, test_last, test_y, data.num_classes, epochs=options["linear_epochs"]
        ),
    }
    if segmentation is not None:
        seg_train_set, seg_test_set, seg_classes = segmentation
        train_grid, train_masks = _grids(backbone, seg_train_set, 128, "segmentation train")
        test_grid, test_masks = _grids(backbone, seg_test_set, 128, "segmentation test")
        result["segmentation"] = segmentation_probe(
            train_grid, train_masks, test_grid, test_masks, seg_classes, epochs=options["seg_epochs"]
        )
        if isinstance(seg_test_set, CompositeScenes):  # label 0 = background here; in ADE20K it is "other"
            result["pca_foreground_iou"] = foreground_iou(pca_foreground(test_grid), test_masks)
    else:
        result["segmentation"] = (
            "skipped: no segmentation data (Fashion-MNIST runs use composite scenes; pass --ade20k ROOT for others)"
        )
    return result


def eval_dino(options: DinoEvalOptions) -> dict[str, Any]:
    """Evaluate DINO runs (``options.run_dirs``): k-NN (k = 10, 20, 100, 200; T = 0.07) of the teacher and of the same
    architecture at random initialisation (the reference a short run must beat), linear probe, segmentation mIoU,
    pictures.

    Writes RUN_DIR/report/eval_dino.json and attention.png per run, and pca.png (images x runs) into ``options.out``
    (default: the first run's report folder). Returns {run_dir: results}. With ``options.reuse`` a run's
    eval_dino.json measured on the same checkpoint with the same options is kept (``lapheads report`` on a sweep);
    the pictures are always redrawn.
    """
    from lapheads.data.images import build_image_data
    from lapheads.runs import RunDir, checkpoint_folder

    run_dirs, device, ade20k = options.run_dirs, options.device, options.ade20k
    seg_train, seg_test = options.seg_train, options.seg_test
    recorded = {  # what eval_dino.json records (and a reuse compares): the keys of its first version
        "version": EVAL_VERSION,
        "max_train": options.max_train,
        "max_test": options.max_examples,
        "seg_train": seg_train,
        "seg_test": seg_test,
        "seg_epochs": options.seg_epochs,
        "linear_epochs": options.linear_epochs,
        "ade20k": ade20k,
    }
    results: dict[str, Any] = {}
    picture_images, pictures = None, []
    for run_dir in run_dirs:
        run = RunDir(run_dir)
        cfg, backbone, record = load_dino_teacher(run_dir, device)
        report = run.report_dir
        report.mkdir(parents=True, exist_ok=True)
        checkpoint = checkpoint_folder(run).name
        cached = (run.read_report(EVAL_FILE) or {}) if options.reuse else {}
        segmentation = _segmentation_sets(cfg, ade20k, seg_train, seg_test)
        if cached.get("checkpoint") == checkpoint and cached.get("options") == recorded:
            result = cached  # the probes are the expensive part; the pictures below are redrawn
        else:
            result = _probe_run(cfg, backbone, record, segmentation, recorded)
            result = {"checkpoint": checkpoint, "laplacian_heads": cfg.laplacian_heads, "options": recorded, **result}
            run.write_report(EVAL_FILE, result)
        if segmentation is not None:
            seg_test_set = segmentation[1]
            images = torch.stack([seg_test_set[i][0] for i in range(min(options.num_pictures, len(seg_test_set)))])
        else:
            test = build_image_data(cfg.dataset, cfg.data_root, cfg.img_size, augment=False).eval
            images = torch.stack([test[i][0] for i in range(min(options.num_pictures, len(test)))])
        laplacian = list(backbone.blocks[-1].attn.heads.flags)
        label = f"k={cfg.laplacian_heads}"
        _plot_attention(
            attention_maps(backbone, images),
            images,
            laplacian,
            f"{label}: CLS attention P of the last block",
            report / "attention.png",
        )
        picture_images = images if picture_images is None else picture_images
        pictures.append((label, Path(run_dir).name, pca_pictures(patch_grid(backbone, picture_images))))
        results[str(run_dir)] = result
    out = Path(options.out) if options.out else RunDir(run_dirs[0]).report_dir
    out.mkdir(parents=True, exist_ok=True)
    named = len({label for label, _, _ in pictures}) < len(pictures)  # runs share a k (seeds): name every column
    _plot_pca(
        picture_images, {f"{label} ({name})" if named else label: rgb for label, name, rgb in pictures}, out / "pca.png"
    )
    for run_dir, result in results.items():
        knn = ", ".join(
            f"k={k} {v:.2f} (random init {result['knn_random_init'][k]:.2f})" for k, v in result["knn"].items()
        )
        seg = result["segmentation"]
        seg = f"mIoU {seg['miou']:.2f}" if isinstance(seg, dict) else seg
        if "pca_foreground_iou" in result:
            seg += f"; PCA foreground IoU {result['pca_foreground_iou']:.2f}"
        log.info(
            f"{run_dir}: k-NN {knn}; linear {result['linear']['test_accuracy']:.2f} (lr {result['linear']['lr']}); "
            f"segmentation {seg}"
        )
    return results
