"""Loading nanochat checkpoints (Karpathy's nanochat and the authors' 2026 fork) into lapheads' GPT.

nanochat writes ``model_<step:06d>.pt`` (a state dict, ``torch.save``) and ``meta_<step:06d>.json`` (with
``model_config``) into one folder per model. Here:

* the model is rebuilt from ``model_config`` alone (:func:`nanochat_gpt_config`: both key sets), on the meta device,
  then ``to_empty`` + ``init_weights`` + a strict ``load_state_dict``, as nanochat's own loader;
* the weights are read with ``torch.load(weights_only=True)`` (``lapheads.io.load_tensor_file``), so a pickle that
  carries code is refused before any of it runs;
* what the fork's loader reconciles is reconciled the same way: ``_orig_mod.`` prefixes of compiled models are
  dropped, and per-layer scalars that an older 2026 checkpoint lacks get the values that reproduce how it was
  trained (residual scale 1, x0 share 0, smear 0, backout 0.2).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from lapheads.errors import CheckpointError, InputError
from lapheads.hardware import check_fits
from lapheads.io import json_loads, load_tensor_file, state_dict_mismatch
from lapheads.models.gpt import GPT, SMEAR_GATE_CHANNELS, GPTConfig

log = logging.getLogger(__name__)

__all__ = ["load_nanochat", "nanochat_gpt_config", "nanochat_steps"]


def nanochat_steps(folder: str | Path) -> list[int]:
    """The steps with both a ``model_<step>.pt`` and a ``meta_<step>.json`` in ``folder``, ascending."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is not a directory; allowed: a nanochat checkpoint folder (model_<step>.pt and meta_<step>.json)"
        )
    steps = []
    for path in folder.glob("model_*.pt"):
        match = re.fullmatch(r"model_(\d+)\.pt", path.name)
        if match and (folder / f"meta_{match.group(1)}.json").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def nanochat_gpt_config(model_config: dict[str, Any], state_keys: set[str] | None = None) -> GPTConfig:
    """The config of a nanochat checkpoint's ``meta_<step>.json`` ``model_config``.

    Both key sets: October 2025 (n_layer, n_head, n_kv_head, n_embd, sequence_len, vocab_size) and the 2026
    fork (plus use_*, window_pattern, laplacian_heads as an int or per-layer list). A 2026 key set, or 2026
    parameters among ``state_keys`` (value_embeds, resid_lambdas, ...), means the 2026 family with each missing
    switch on, as the fork's own loader assumes; otherwise the 2025 family.
    """
    required = ("n_layer", "n_head", "n_embd", "sequence_len", "vocab_size")
    missing = [k for k in required if k not in model_config]
    if missing:
        raise InputError(f"nanochat model_config lacks {', '.join(missing)}; allowed: a nanochat meta_<step>.json")
    for key in (*required, "n_kv_head"):  # an integer >= 1 each: n_head 0 divided by zero below (issue 76)
        value = model_config.get(key, 1)
        if type(value) is not int or value < 1:
            raise InputError(f"nanochat model_config {key} {value!r}; allowed: an integer >= 1")
    known = {*required, "n_kv_head", "laplacian_heads", "window_pattern", "use_ve", "use_resid_lambdas", "use_x0",
             "use_smear", "use_backout"}  # fmt: skip
    unknown = sorted(set(model_config) - known)
    if unknown:  # said, not refused: a newer fork's checkpoint may carry keys that change nothing this loader builds
        log.warning(
            f"lapheads: nanochat model_config keys this loader does not read: {', '.join(unknown)} (the model is "
            "built without them; a key that changes the architecture shows as a weight mismatch next)"
        )
    switches = ("use_ve", "use_resid_lambdas", "use_x0", "use_smear", "use_backout")
    markers = ("value_embeds.", "resid_lambdas", "x0_lambdas", "smear_", "backout_lambda")
    is_2026 = any(k in model_config for k in (*switches, "window_pattern")) or any(
        key.startswith(markers) for key in (state_keys or ())
    )
    spec = model_config.get("laplacian_heads", 0)
    options: dict[str, Any] = {}
    if is_2026:
        options = {k: bool(model_config.get(k, True)) for k in switches}
        options["window_pattern"] = model_config.get("window_pattern", "L")
    return GPTConfig(
        depth=int(model_config["n_layer"]),
        vocab_size=int(model_config["vocab_size"]),
        sequence_len=int(model_config["sequence_len"]),
        width=int(model_config["n_embd"]),
        num_heads=int(model_config["n_head"]),
        n_kv_head=int(model_config.get("n_kv_head", model_config["n_head"])),
        head_dim=int(model_config["n_embd"]) // int(model_config["n_head"]),
        laplacian_heads=list(spec) if isinstance(spec, (list, tuple)) else int(spec),
        arch="nanochat-2026" if is_2026 else "nanochat-2025",
        **options,
    )


def _missing_scalars(config: GPTConfig) -> list[tuple[str, bool, tuple[int, ...], float]]:
    return [
        ("resid_lambdas", bool(config.use_resid_lambdas), (config.depth,), 1.0),  # identity scaling
        ("x0_lambdas", bool(config.use_x0), (config.depth,), 0.0),  # no re-injection
        ("smear_lambda", bool(config.use_smear), (1,), 0.0),
        ("smear_gate.weight", bool(config.use_smear), (1, SMEAR_GATE_CHANNELS), 0.0),
        ("backout_lambda", bool(config.use_backout), (1,), 0.2),
    ]


def _check_size(config: GPTConfig, state: dict[str, torch.Tensor], meta_file: Path, device) -> None:
    """Before a block is built: the model_config's depth is the weights' (a meta file saying 1,000,000 layers would
    otherwise build for minutes and then run out of memory), and the model fits the device."""
    blocks = {key.split(".")[2] for key in state if key.startswith("transformer.h.") and key.count(".") >= 3}
    if len(blocks) != config.depth:
        raise CheckpointError(
            f"{meta_file} says n_layer {config.depth:,} but the weights hold {len(blocks):,} blocks; allowed: the "
            "model_config the checkpoint was saved with"
        )
    check_fits(f"nanochat GPT (depth {config.depth}, width {config.n_embd})", config.estimated_bytes(),
               torch.device(device).type)  # fmt: skip


def load_nanochat(
    folder: str | Path, step: int | None = None, device: str | torch.device = "cpu", laplacian_heads: Any = None
) -> tuple[GPT, dict[str, Any]]:
    """A nanochat checkpoint as lapheads' GPT, in eval mode; returns (model, the checkpoint's meta).

    Args:
        folder: the checkpoint folder (``model_<step>.pt``, ``meta_<step>.json``).
        step: which step; None = the last one.
        device: where the model goes.
        laplacian_heads: override the checkpoint's spec (None: keep ``model_config['laplacian_heads']``, else 0).

    Raises:
        CheckpointError: a missing folder or step, a corrupt or unsafe file, or weights that do not match.
    """
    folder = Path(folder)
    steps = nanochat_steps(folder)
    if not steps:
        raise CheckpointError(f"{folder} holds no nanochat checkpoint (model_<step>.pt with meta_<step>.json)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"{folder} has no step {step}; allowed: {', '.join(map(str, steps))}")
    meta_file = folder / f"meta_{step:06d}.json"
    try:
        meta = json_loads(meta_file.read_text())
        model_config = dict(meta["model_config"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{meta_file} is not a nanochat meta file with a model_config ({err})") from None
    state = {k.removeprefix("_orig_mod."): v for k, v in load_tensor_file(folder / f"model_{step:06d}.pt").items()}
    if laplacian_heads is not None:
        model_config["laplacian_heads"] = laplacian_heads
    config = nanochat_gpt_config(model_config, state_keys=set(state))
    _check_size(config, state, meta_file, device)
    for key, enabled, shape, fill in _missing_scalars(config):
        if enabled and key not in state:
            state[key] = torch.full(shape, fill)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()  # rotary tables (and anything the checkpoint does not hold)
    detail = state_dict_mismatch(model.state_dict(), state)
    if detail:
        raise CheckpointError(f"{folder} step {step} does not match its own model_config ({detail})")
    model.load_state_dict(state, strict=True)
    meta["model_config"] = config.to_dict()
    meta["step"] = step
    return model.eval(), meta
