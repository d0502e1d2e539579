"""The geometry of one run, as an evaluation: its model on its evaluation data, every metric per layer.

``lapheads analyze`` (``lapheads.study.analyze``) caches these per run and compares runs side by side; the task
table names the analyzer of each task (``analyzer``). Design choices:

* **Run directories are the input.** The model is rebuilt from config.json and the latest checkpoint (or a kept
  one); the data is the run's evaluation split with evaluation transforms. Nothing else about the training is assumed.
* **Streaming.** Each batch's residual stream is captured by hooks, fed to the accumulators of every layer and
  dropped; only per-sequence means (N_seq x D per layer, float32) are kept, for the nearest-class-centre test.
* **A fixed random subset.** ``max_tokens`` caps the tokens per layer; the sequences are a seeded random subset of
  the split (evaluation sets are often sorted by class, so the first N would miss classes).
* **All tokens.** Prefix tokens (CLS) count as tokens of their sequence, as in the paper's token-level analyses.

Per task: classify runs get ANOVA, Neural Collapse on sequence means and on tokens (and on the classifier's input,
with nc3/nc4), spectra and token similarity; lm runs get spectra, token similarity and linguistic collapse (CDNV
and NC1 with the K most frequent next tokens as classes) on validation windows; dino runs get the supervised set
without the classifier rows (the teacher backbone, with the dataset's labels as classes).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from lapheads.distributed import resolve_device
from lapheads.errors import InputError
from lapheads.geometry.collapse import neural_collapse
from lapheads.geometry.features import ResidualStream, select_layers
from lapheads.geometry.layers import LayerGeometry, LMLayerGeometry
from lapheads.geometry.linguistic import top_k_classes
from lapheads.geometry.mechanism import HeadEffects, gated_heads, ov_circuits
from lapheads.hardware import full_fp32
from lapheads.runs import RunDir, checkpoint_folder, load_model

__all__ = ["ANALYSIS_VERSION", "AnalyzeOptions", "analyze_classify", "analyze_dino", "analyze_lm", "lm_geometry"]

#: bumped when an analysis gains a metric (2: output-value circuits of every head; 5: kind-aware diffusion, and
#: tau, p_diffusion and fraction_drop from the data; 6: the language model's ANOVA of token variance per layer)
ANALYSIS_VERSION = 6


@dataclass
class AnalyzeOptions:
    """What to measure. Args: layers ("all" or "embed,3,norm"); max_tokens per layer; fraction of variance for
    the spectra; top_k next-token classes for linguistic collapse (LM); batch_size; ema (analyse the EMA weights);
    device ("auto", "cpu", "cuda")."""

    layers: str = "all"
    max_tokens: int = 1_000_000
    fraction: float = 0.99
    top_k: int = 100
    batch_size: int = 256
    ema: bool = False
    device: str = "auto"
    step: int | None = None  # a kept checkpoint's step (None: the latest)

    def cache_key(self) -> dict[str, Any]:
        # the version changes whenever an analysis gains a metric, so older cached files are recomputed
        return {
            **{k: v for k, v in asdict(self).items() if k not in ("batch_size", "device")},
            "version": ANALYSIS_VERSION,
        }


def lm_geometry(model: torch.nn.Module, val_tokens, seq_len: int, options: AnalyzeOptions, name: str) -> dict[str, Any]:
    """Per-layer geometry of a GPT over the first ``options.max_tokens`` of ``val_tokens`` in windows of ``seq_len``.

    Classes are the ranks of each next token among the K most frequent next tokens of the analysed text (others -1).
    """
    from lapheads.data.text import validation_windows

    device = model.lm_head.weight.device
    layers = select_layers(model, options.layers)
    windows = list(validation_windows(val_tokens, seq_len, options.max_tokens))
    if not windows:
        raise InputError(f"{name}: the validation text has fewer than {seq_len + 1} tokens; allowed: more text")
    targets = torch.cat([y for _, y in windows])
    classes = top_k_classes(
        targets, torch.bincount(targets.reshape(-1), minlength=model.config.vocab_size), options.top_k
    )
    geometry = {layer: LMLayerGeometry(options.fraction) for layer in layers}
    nats = 0.0
    batch = max(1, options.batch_size // 8)
    effects = _head_effects(model)
    with ResidualStream(model, layers) as stream, effects or contextlib.nullcontext(), torch.no_grad():
        for start in tqdm(range(0, len(windows), batch), desc=f"analyze {name}", dynamic_ncols=True, leave=False):
            x = torch.cat([w[0] for w in windows[start : start + batch]]).to(device)
            y = targets[start : start + batch]
            nats += float(model(x, y.to(device), loss_reduction="sum"))
            if effects is not None:
                effects.update()
            for layer in layers:
                geometry[layer].update(stream.tokens[layer], classes[start : start + batch])
    per_layer = {layer: geometry[layer].compute() for layer in layers}
    _add_mechanism(per_layer, model, effects)
    return {
        "task": "lm",
        "split": "val",
        "num_sequences": len(windows),
        "tokens_per_sequence": seq_len,
        "next_token_loss": nats / targets.numel(),
        "top_k": options.top_k,
        "layers": layers,
        "per_layer": per_layer,
    }


def _head_effects(model: torch.nn.Module) -> HeadEffects | None:
    """The per-head measures to take while analysing, or None for a model with gated heads (no fixed operator per
    head: ``geometry.mechanism.gated_heads``; its analysis has geometry and no mechanism)."""
    return HeadEffects(model) if gated_heads(model) is None else None


def _add_mechanism(per_layer: dict[str, dict[str, Any]], model: torch.nn.Module, effects: HeadEffects | None) -> None:
    """Each analysed block gains its heads' scores (``geometry.mechanism``: the output-value circuit from the
    weights, and ``tau``, ``p_diffusion``, ``fraction_drop`` from the data just analysed) and the mean diffusion
    score of its Laplacian and of its ordinary heads (None where the block has none of a kind: JSON keeps it, and a
    cached analysis compares equal to a fresh one); nothing for a model with gated heads (``effects`` None)."""
    if effects is None:
        return
    circuits = ov_circuits(model)
    for i, (heads, measured) in enumerate(zip(circuits, effects.compute(circuits))):
        if str(i + 1) not in per_layer:
            continue
        heads = [{**circuit, **data} for circuit, data in zip(heads, measured)]
        means = {}
        for name, kind, key in (
            ("laplacian_diffusion", "laplacian", "diffusion"),
            ("ordinary_diffusion", "ordinary", "diffusion"),
            ("ordinary_as_laplacian", "ordinary", "as_laplacian"),  # the null of this block's Laplacian heads
        ):
            # ordinary means ordinary: heads of the other kinds (negated, centring, ...) are neither mean
            scores = [h[key] for h in heads if h["kind"] == kind]
            means[name] = sum(scores) / len(scores) if scores else None
        per_layer[str(i + 1)]["mechanism"] = {**means, "heads": heads}


def analyze_lm(run: RunDir, options: AnalyzeOptions) -> dict[str, Any]:
    from lapheads.data.images import DataError
    from lapheads.runs import load_token_shards

    if options.ema:
        raise InputError("--ema: language-model runs keep no EMA weights")
    cfg = run.settings()
    shards = load_token_shards(run)
    if shards is None:
        raise DataError(f"{run.path}: the run's token shards are missing; train or prepare {cfg.dataset} first")
    model = load_model(run, step=options.step, device=options.device)
    return {
        "checkpoint": checkpoint_folder(run, options.step).name,
        "laplacian_heads": cfg.laplacian_heads,
        "seed": cfg.seed,
        "dataset": cfg.dataset,
        **lm_geometry(model, shards.val, cfg.sequence_len, options, run.path.name),
    }


def _eval_images(cfg):
    """The evaluation split a classify / dino run was measured on (its --eval-subset, if any)."""
    from lapheads.data.images import build_image_data

    dataset = build_image_data(cfg.dataset, cfg.data_root, cfg.img_size, augment=False).eval
    subset = getattr(cfg, "eval_subset", None)
    return dataset if subset is None else torch.utils.data.Subset(dataset, range(min(subset, len(dataset))))


def _labelled_geometry(
    model: torch.nn.Module, dataset, options: AnalyzeOptions, run_path: Path, classifier: bool
) -> dict[str, Any]:
    """Per-layer geometry of a ViT over a seeded random subset of a labelled image set (classify and dino runs).

    With ``classifier`` the model's predictions feed NC4 and the classifier's input gets its own NC entry.
    """
    device = resolve_device(options.device)
    full_fp32(device)  # measured in fp32 as trained in fp32: no TF32 patch embedding on a GPU
    model.to(device)
    layers = select_layers(model, options.layers)
    tokens_per_seq = model.patch_embed.num_patches + model.num_prefix_tokens
    num_seq = min(len(dataset), max(2, options.max_tokens // tokens_per_seq))
    chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))[:num_seq].sort().values
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, chosen.tolist()), batch_size=options.batch_size
    )

    geometry = {name: LayerGeometry(options.fraction) for name in layers}
    head_inputs, labels_all, predictions_all = [], [], []
    effects = _head_effects(model)
    with (
        ResidualStream(model, layers, head_input=classifier) as stream,
        effects or contextlib.nullcontext(),
        torch.no_grad(),
    ):
        for images, labels in tqdm(loader, desc=f"analyze {run_path.name}", dynamic_ncols=True, leave=False):
            logits = model(images.to(device))
            if effects is not None:
                effects.update()
            for name in layers:
                geometry[name].update(stream.tokens[name], labels)
            labels_all.append(labels)
            if classifier:
                head_inputs.append(stream.head_input.float().cpu())
                predictions_all.append(logits.argmax(1).cpu())
    labels = torch.cat(labels_all)
    predictions = torch.cat(predictions_all) if classifier else None
    per_layer = {name: geometry[name].compute(labels, predictions) for name in layers}
    _add_mechanism(per_layer, model, effects)
    out: dict[str, Any] = {
        "split": "eval",
        "num_sequences": num_seq,
        "tokens_per_sequence": tokens_per_seq,
        "layers": layers,
        "per_layer": per_layer,
    }
    if classifier:
        out["accuracy"] = float((predictions == labels).double().mean())
        out["head_input"] = neural_collapse(
            torch.cat(head_inputs), labels, classifier=model.get_classifier().weight, predictions=predictions
        )
    return out


def analyze_classify(run: RunDir, options: AnalyzeOptions) -> dict[str, Any]:
    cfg = run.settings()
    model = load_model(run, "ema" if options.ema else "model", options.step, options.device)
    return {
        "task": "classify",
        "checkpoint": checkpoint_folder(run, options.step).name,
        "laplacian_heads": cfg.laplacian_heads,
        "seed": cfg.seed,
        "dataset": cfg.dataset,
        **_labelled_geometry(model, _eval_images(cfg), options, run.path, classifier=True),
    }


def analyze_dino(run: RunDir, options: AnalyzeOptions) -> dict[str, Any]:
    """The teacher backbone on the evaluation split; the dataset's labels give the ANOVA classes."""
    if options.ema:
        raise InputError("--ema: a DINO run's teacher already is the EMA model; analyze uses it")
    cfg = run.settings()
    backbone = load_model(run, "teacher", options.step, options.device)  # the dino task's analyzed_weights
    return {
        "task": "dino",
        "checkpoint": checkpoint_folder(run, options.step).name,
        "laplacian_heads": cfg.laplacian_heads,
        "seed": cfg.seed,
        "dataset": cfg.dataset,
        **_labelled_geometry(backbone, _eval_images(cfg), options, run.path, classifier=False),
    }
