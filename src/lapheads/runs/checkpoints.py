"""Checkpoints of a run directory: written atomically, loaded without pickle, the same trajectory after a resume.

Design choices:

* **Checkpoints without pickle.** Weights, optimizer tensors and RNG states are safetensors; everything else is
  JSON. A checkpoint is written into a temporary folder, then renamed into place, then ``latest`` is replaced
  atomically: a crash at any point leaves the previous checkpoint intact.
* **Never from non-finite weights.** Weights that overflowed without a NaN loss yet do not replace the last good
  checkpoint.
* **Every rank's RNG**, and the state of optimizers sharded across ranks (``sharded = True``), is its own file; the
  rest is written by rank 0 and published after a barrier.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from lapheads.distributed import Distributed
from lapheads.errors import CheckpointError, LapheadsError
from lapheads.io import atomic_write_text, json_loads, load_safetensors
from lapheads.runs.directory import RunDir, latest_checkpoint
from lapheads.runs.layout import LATEST, STATE_FILE, STEP_PREFIX, WEIGHTS, step_name, temporary_step_name
from lapheads.runs.models import load_weights

__all__ = ["NonFiniteLossError", "kept_checkpoint", "load_checkpoint", "save_checkpoint"]


class NonFiniteLossError(LapheadsError, RuntimeError):
    """The loss became NaN or inf; the message names the step."""


def kept_checkpoint(run: RunDir) -> str:
    """Where a stopped run can resume from, in words."""
    try:
        folder = latest_checkpoint(run)
    except CheckpointError:
        folder = None
    if folder is None:
        return "no checkpoint was written yet"
    return f"the last checkpoint {folder} is intact (resume with --resume)"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    state["numpy_keys"] = torch.from_numpy(np_state[1].astype(np.int64))
    state["numpy_meta"] = torch.tensor([np_state[2], np_state[3]], dtype=torch.int64)
    state["numpy_gauss"] = torch.tensor([np_state[4]], dtype=torch.float64)
    py_state = random.getstate()
    state["python"] = torch.tensor(py_state[1], dtype=torch.int64)
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    meta = state["numpy_meta"].tolist()
    np.random.set_state(
        ("MT19937", state["numpy_keys"].numpy().astype(np.uint32), meta[0], meta[1], float(state["numpy_gauss"][0]))
    )
    random.setstate((3, tuple(state["python"].tolist()), None))


def _flatten_optimizer(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state -> (tensors for safetensors, JSON for the rest)."""
    tensors, scalars = {}, {}
    for param_id, param_state in state_dict["state"].items():
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param_id}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{param_id}.{name}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        param_id, name = key.split(".", 1)
        state.setdefault(int(param_id), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def _optimizer_files(
    optimizer: torch.optim.Optimizer | dict[str, torch.optim.Optimizer] | None,
) -> dict[str, torch.optim.Optimizer]:
    if optimizer is None:
        return {}
    if isinstance(optimizer, dict):
        return {f"optimizer-{name}": opt for name, opt in optimizer.items()}
    return {"optimizer": optimizer}


def _sharded(optimizer, dist_: Distributed) -> dict[str, torch.optim.Optimizer]:
    """The optimizers whose state is split across the ranks (``sharded = True``, e.g. ``ShardedMuon``)."""
    if not dist_.enabled:
        return {}
    return {file: opt for file, opt in _optimizer_files(optimizer).items() if getattr(opt, "sharded", False)}


def save_checkpoint(
    run: RunDir,
    step: int,
    dist_: Distributed,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | dict[str, torch.optim.Optimizer],
    trainer_state: dict[str, Any],
    extra_models: dict[str, torch.nn.Module] | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoints/step-<step>/ atomically and point checkpoints/latest at it; keep the newest ``keep`` (0: all).

    ``optimizer`` is one optimizer (optimizer.safetensors) or several by name (optimizer-<name>.safetensors, e.g.
    AdamW and Muon of the GPT).

    Every rank writes its RNG state; rank 0 writes the rest and publishes the folder after a barrier.
    """
    final = run.checkpoints / step_name(step)
    tmp = run.checkpoints / temporary_step_name(step)
    # Weights that overflowed without a NaN loss yet must not replace the last good checkpoint.
    if not bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all()):  # one host sync
        raise NonFiniteLossError(
            f"the weights are not finite after step {step}; not saving them; "
            f"{kept_checkpoint(run)} (lower the learning rates)"
        )
    try:
        if dist_.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist_.barrier()
        save_file(_rng_state(), str(tmp / f"rng-rank{dist_.rank}.safetensors"))
        for file, opt in _sharded(optimizer, dist_).items():  # every rank holds its own part of these
            opt_tensors, meta = _flatten_optimizer(opt.state_dict())
            save_file(opt_tensors, str(tmp / f"{file}-rank{dist_.rank}.safetensors"))
            (tmp / f"{file}-rank{dist_.rank}.json").write_text(json.dumps(meta))
        if dist_.is_main:
            for name, module in {"model": model, **(extra_models or {})}.items():
                tensors = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
                save_file(tensors, str(tmp / f"{name}.safetensors"))
            metas = {}
            for file, opt in _optimizer_files(optimizer).items():
                if file in _sharded(optimizer, dist_):
                    metas[file] = {"sharded": dist_.world_size}
                    continue
                opt_tensors, metas[file] = _flatten_optimizer(opt.state_dict())
                save_file(opt_tensors, str(tmp / f"{file}.safetensors"))
            state = {"step": step, "world_size": dist_.world_size, "optimizer": metas, **trainer_state}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    except (OSError, SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"cannot write the step-{step} checkpoint into {run.checkpoints} "
            f"({str(err).splitlines()[0][:100]}); free disk space or make it writable, then "
            f"--resume; {kept_checkpoint(run)}"
        ) from None
    dist_.barrier()
    if dist_.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write_text(run.checkpoints / LATEST, final.name + "\n")
        for old in sorted(run.checkpoints.glob(STEP_PREFIX + "*"))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist_.barrier()
    return final


def load_checkpoint(
    folder: Path,
    dist_: Distributed,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | dict[str, torch.optim.Optimizer] | None,
    extra_models: dict[str, torch.nn.Module] | None = None,
) -> dict[str, Any]:
    """Restore weights, optimizer, this rank's RNG state; return the trainer state."""
    try:
        state = json_loads((folder / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{folder}/state.json is missing or corrupt: {err}") from None
    if state.get("world_size", 1) != dist_.world_size:
        raise CheckpointError(
            f"{folder} was written by {state['world_size']} processes; resuming with {dist_.world_size} would change "
            "the data order; allowed: the same world size"
        )
    load_weights(model, folder / WEIGHTS["model"])
    for name, module in (extra_models or {}).items():
        load_weights(module, folder / f"{name}.safetensors")
    for file, opt in _optimizer_files(optimizer).items():
        if file not in state["optimizer"]:
            raise CheckpointError(f"{folder} holds no {file} state; allowed: resume with the optimizers that wrote it")
        meta = state["optimizer"][file]
        if "sharded" in meta:  # each rank wrote its own part (same world size: checked above)
            try:
                meta = json_loads((folder / f"{file}-rank{dist_.rank}.json").read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise CheckpointError(f"{folder}/{file}-rank{dist_.rank}.json is missing or corrupt: {err}") from None
            file = f"{file}-rank{dist_.rank}"
        opt.load_state_dict(_unflatten_optimizer(load_safetensors(folder / f"{file}.safetensors"), meta))
    _set_rng_state(load_safetensors(folder / f"rng-rank{dist_.rank}.safetensors"))
    return state
