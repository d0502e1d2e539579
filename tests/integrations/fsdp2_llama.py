"""One FSDP2 training run of a tiny Llama with Laplacian heads, launched by tests/integrations/test_fsdp2.py under
torchrun (1 or 2 gloo processes): one global batch, split across the ranks, learnt for a few steps; rank 0 writes the
losses, the first step's full gradients and the trained model (save_pretrained) to the folder it is given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lapheads.hf as lhf

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
GLOBAL_BATCH, STEPS = 4, 3


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = lhf.enable(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), "0,2")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:  # one FSDP unit per decoder layer, then the rest (embeddings, head)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 100, (GLOBAL_BATCH, 16), generator=torch.Generator().manual_seed(1))
    losses, first_grads = [], {}
    for step in range(STEPS):
        ids = batch[rank::world]  # this rank's share of the global batch (the same one every step: it is learnt)
        loss = model(input_ids=ids, labels=ids).loss  # FSDP2 averages gradients over ranks: the global mean
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / world).item())
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps(losses))
        save_file({n: g.contiguous() for n, g in first_grads.items()}, str(out / "grads.safetensors"))
        plain = lhf.enable(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), "0,2")
        plain.load_state_dict(state)
        plain.save_pretrained(out / "model")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
