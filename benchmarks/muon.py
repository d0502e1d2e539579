"""Benchmark: Muon under DDP, every rank orthogonalising every matrix (``torch.optim.Muon``) against each rank doing
its share and broadcasting (``lapheads.train.muon.ShardedMuon``).

Two gloo ranks on CPU (1 thread each), the shakespeare-cpu GPT (depth 4, 256 dim, T = 256) by default; the two
forms train identical copies of the model, timed interleaved in one run (the same shuffled order on both ranks, so
their collectives pair up). Reported: median seconds of the optimizer steps alone and of the whole training step
(forward, backward with DDP's all-reduce, AdamW + Muon), and the Muon state each rank holds.

    python benchmarks/muon.py                    # ~1 minute on 2 CPU cores; keep the machine otherwise idle
    python benchmarks/muon.py --depth 8 --world-size 2 --repeats 20
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    from torch.nn.parallel import DistributedDataParallel

    from lapheads.bench import time_interleaved
    from lapheads.distributed import Distributed
    from lapheads.models.gpt import GPT, GPTConfig
    from lapheads.train.configs.lm import LMConfig
    from lapheads.train.optimizers import build_optimizers

    setups = {}
    for form in ("plain", "sharded"):
        torch.manual_seed(0)
        model = GPT(
            GPTConfig(
                depth=args.depth, vocab_size=320, sequence_len=256, aspect_ratio=64, head_dim=64, laplacian_heads=2
            )
        )
        world = Distributed(rank, args.world_size) if form == "sharded" else Distributed()  # 1 rank = unsharded
        optimizers = build_optimizers(model, LMConfig(), world)
        setups[form] = (model, DistributedDataParallel(model), optimizers)
    tokens = torch.randint(0, 320, (args.batch, 257), generator=torch.Generator().manual_seed(rank))

    def optimizer_steps(form: str) -> None:
        for opt in setups[form][2].values():
            opt.step()

    def whole_step(form: str) -> None:
        model, ddp, optimizers = setups[form]
        ddp(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer_steps(form)
        model.zero_grad(set_to_none=True)

    for form in setups:  # gradients for the optimizer-only timing
        setups[form][1](tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer_only = time_interleaved({form: (lambda f=form: optimizer_steps(f)) for form in setups}, args.repeats)
    whole = time_interleaved({form: (lambda f=form: whole_step(f)) for form in setups}, args.repeats)
    state = {
        form: sum(
            v.numel() for s in setups[form][2]["muon"].state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
        for form in setups
    }
    gathered = [None] * args.world_size
    dist.all_gather_object(gathered, state)
    if rank == 0:
        print(
            f"{args.world_size} gloo ranks x 1 thread, GPT depth {args.depth} (256 dim, T 256, batch {args.batch} "
            f"per rank), {args.repeats} interleaved repeats, medians:"
        )
        print("| Muon | optimizer steps (s) | whole step (s) | Muon state per rank (elements) |")
        print("|---|---|---|---|")
        for form in setups:
            per_rank = " / ".join(f"{g[form]:,}" for g in gathered)
            print(f"| {form} | {optimizer_only[form]:.4f} | {whole[form]:.4f} | {per_rank} |")
        print(
            f"sharded / plain: optimizer steps {optimizer_only['sharded'] / optimizer_only['plain']:.3f}x, "
            f"whole step {whole['sharded'] / whole['plain']:.3f}x"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
