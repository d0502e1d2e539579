"""A run's model, rebuilt from the constructor arguments config.json records, its weights and tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from lapheads.distributed import resolve_device
from lapheads.errors import CheckpointError, InputError
from lapheads.io import load_safetensors, state_dict_mismatch
from lapheads.runs.directory import RunDir, checkpoint_folder, files_within
from lapheads.runs.layout import RUN_TASKS, WEIGHTS, nanochat_tokenizer_dir


def load_weights(module: torch.nn.Module, path: Path, prefix: str = "") -> None:
    """Load a safetensors state dict with strict key and shape checks and a one-line error on mismatch.

    With ``prefix`` only the tensors under it are loaded, the prefix removed (a DINO checkpoint's ``backbone.``).
    """
    tensors = load_safetensors(path)
    if prefix:
        tensors = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    detail = state_dict_mismatch(module.state_dict(), tensors)
    if detail:
        raise CheckpointError(f"{path} does not match the model ({detail}); was it written by a different config?")
    module.load_state_dict(tensors, strict=True)


# ----------------------------------------------------------------------------------------------------------------
# The model of a run


def _vit(**kwargs: Any) -> torch.nn.Module:
    from lapheads.models.vit import create_vit

    return create_vit(**kwargs)


def _gpt(**kwargs: Any) -> torch.nn.Module:
    from lapheads.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(**kwargs))


#: how a recorded model is rebuilt: ``factory(**kwargs)``
FACTORIES = {"vit": _vit, "gpt": _gpt}


def model_record(factory: str, kwargs: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """What training writes as config.json's ``"model"``: the factory, its keyword arguments (JSON) and the prefix
    under which the weight files hold the model (DINO's ``backbone.``)."""
    if factory not in FACTORIES:
        raise InputError(f"model factory {factory!r}; allowed: {', '.join(FACTORIES)}")
    record = {"factory": factory, "kwargs": json.loads(json.dumps(kwargs))}
    return record | ({"prefix": prefix} if prefix else {})


def build_model(record: dict[str, Any]) -> torch.nn.Module:
    """The untrained model of a ``model_record``; arguments its constructor does not take are a one-line error."""
    factory = record.get("factory") if isinstance(record, dict) else None
    if factory not in FACTORIES or not isinstance(record.get("kwargs"), dict):
        raise CheckpointError(f"model record {str(record)[:80]}; allowed: factory one of {', '.join(FACTORIES)}")
    try:
        return FACTORIES[factory](**record["kwargs"])
    except TypeError as err:  # an unknown or misspelt constructor argument
        raise CheckpointError(f"the recorded model arguments do not build a {factory} model: {err}") from None


def trained_on_conversations(record: dict[str, Any]) -> bool:
    """Whether a run's config.json says it trained on conversations (mid and sft runs record how many, since their
    first version): chat, serve and the chat evaluations read only those. A fact of the run, not a list of task
    names (the task table, above runs/, owns the tasks)."""
    return isinstance(record.get("conversations"), int) and not isinstance(record.get("conversations"), bool)


def _record_of(run: RunDir, record: dict[str, Any]) -> dict[str, Any]:
    if record.get("task") not in RUN_TASKS:
        raise CheckpointError(
            f"{run.path}/config.json records task {str(record.get('task'))[:60]!r}; allowed: {', '.join(RUN_TASKS)}"
        )
    model = record.get("model")
    if isinstance(model, dict) and "factory" not in model and trained_on_conversations(record):
        model = {"factory": "gpt", "kwargs": model}  # chat runs of lapheads 0.1 recorded GPTConfig's fields only
    if isinstance(model, dict) and "factory" in model and model["factory"] not in FACTORIES:
        raise CheckpointError(
            f"{run.path}/config.json records model factory {str(model['factory'])[:60]!r}; allowed: "
            f"{', '.join(FACTORIES)}"
        )
    if not isinstance(model, dict) or model.get("factory") not in FACTORIES:
        raise CheckpointError(
            f"{run.path} was written before lapheads recorded its model's constructor arguments; "
            f"convert it with: lapheads upgrade {run.path}"
        )
    return model


def load_model(
    run_dir: str | os.PathLike | RunDir,
    weights: str = "model",
    step: int | None = None,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A run's trained model in eval mode, rebuilt from config.json's ``"model"`` alone.

    Args:
        run_dir: a run directory (any task).
        weights: "model" (the trained weights), "ema" (classify with --ema-decay) or "teacher" (DINO).
        step: a kept checkpoint's step; None = the latest.
        device: "cpu", "cuda", "auto", ...
    LoRA runs (sft --lora-rank) are rebuilt on the base they were trained from, their adapters merged.
    """
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    if weights not in WEIGHTS:
        raise InputError(f"weights {weights!r}; allowed: {', '.join(WEIGHTS)}")
    record = run.read_config()
    spec = _record_of(run, record)
    folder = checkpoint_folder(run, step)
    file = folder / WEIGHTS[weights]
    if not file.is_file():
        raise CheckpointError(
            f"{file} does not exist; allowed weights of this run: "
            f"{', '.join(w for w, f in WEIGHTS.items() if (folder / f).is_file())}"
        )
    config = record.get("config", {})
    if config.get("lora_rank"):
        from lapheads.models.lora import LoraAdapters, apply_lora

        base = _load_source(record, device)  # the adapters were trained on it
        peft_model = apply_lora(
            base, config["lora_rank"], config["lora_alpha"], config["lora_dropout"], config["lora_targets"]
        )
        load_weights(LoraAdapters(peft_model), file)
        return peft_model.merge_and_unload().to(resolve_device(device)).eval()
    model = build_model(spec)
    load_weights(model, file, spec.get("prefix", ""))
    return model.to(resolve_device(device)).eval()


def _load_source(record: dict[str, Any], device: str | torch.device) -> torch.nn.Module:
    """The model a chat run recorded it started from: another run (``base_run``) or a nanochat checkpoint."""
    if record.get("nanochat"):
        from lapheads.models.nanochat import load_nanochat

        return load_nanochat(record["nanochat"], record["nanochat_step"], resolve_device(device))[0]
    return load_model(record["base_run"], device=device)


def load_run_tokenizer(run_dir: str | os.PathLike | RunDir, vocab_size: int | None = None):
    """The tokenizer an lm / mid / sft run was trained with (RUN_DIR/tokenizer); with ``vocab_size`` a tokenizer of
    another size is a one-line error."""
    from lapheads.data.tokenizers import load_tokenizer

    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    tokenizer = load_tokenizer(files_within(run.tokenizer_dir))
    if vocab_size is not None and tokenizer.vocab_size != vocab_size:
        raise CheckpointError(
            f"{run.path}/tokenizer has {tokenizer.vocab_size} tokens but the model was trained with "
            f"{vocab_size}; allowed: the run's own tokenizer"
        )
    return tokenizer


def load_nanochat_model(
    folder: str | os.PathLike,
    step: int | None = None,
    device: str | torch.device = "cpu",
    tokenizer_dir: str | os.PathLike | None = None,
):
    """A model from outside lapheads: a nanochat checkpoint folder as (GPT in eval mode, its tokenizer, its meta).

    The tokenizer is ``tokenizer_dir/tokenizer.pkl``, by default nanochat's own layout (``<base>/base_checkpoints/
    <tag>/`` beside ``<base>/tokenizer/``); one of another size than the model's vocabulary is a one-line error.
    Every command that takes ``--nanochat`` loads through here (eval lm, chat, serve, mid, sft).
    """
    from lapheads.data.tokenizers import Tokenizer
    from lapheads.models.nanochat import load_nanochat

    folder = Path(folder)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else nanochat_tokenizer_dir(folder)
    tokenizer = Tokenizer.nanochat(tokenizer_dir)
    model, meta = load_nanochat(folder, step, resolve_device(device))
    if tokenizer.vocab_size != model.config.vocab_size:
        raise InputError(
            f"{tokenizer_dir} has {tokenizer.vocab_size} tokens but {folder} was trained with "
            f"{model.config.vocab_size}; allowed: the checkpoint's own tokenizer (--nanochat-tokenizer)"
        )
    return model, tokenizer, meta


# ----------------------------------------------------------------------------------------------------------------
# Language-model runs (lm, mid, sft): the GPT and its tokenizer


def load_gpt_run(run_dir: str | os.PathLike, device: str = "auto", step: int | None = None):
    """(config.json's record, model in eval mode, tokenizer) of a run whose model is a GPT (lm, mid, sft); LoRA
    adapters are merged."""
    run = RunDir(run_dir)
    record = run.read_config()
    entry = record.get("model")
    factory = entry.get("factory") if isinstance(entry, dict) else None
    if factory is not None and factory != "gpt":  # (a record without one: load_model names the upgrade)
        raise CheckpointError(
            f"{run.path} holds a {record.get('task')!r} run, whose model is a {factory!r}; allowed here: a GPT's run "
            "(lm, mid, sft)"
        )
    model = load_model(run, step=step, device=device)
    return record, model, load_run_tokenizer(run, record.get("vocab_size"))


def load_token_shards(run_dir: str | os.PathLike | RunDir):
    """The token shards an lm run trained on (config.json's ``"tokens"``), or None where they are not here (a run
    directory copied without its data, a chat run): evaluations that need no shards still work."""
    from lapheads.data.images import DataError
    from lapheads.data.text import TokenShards

    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    folder = run.read_config().get("tokens")
    if not folder:
        return None
    try:
        return TokenShards.open(folder)
    except DataError:
        return None
