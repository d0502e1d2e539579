"""Sharded Muon: each rank orthogonalises its share of the matrices; the result equals torch.optim.Muon on one rank,
and each rank keeps only its share of the momentum state."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lapheads.train.muon import ShardedMuon, assign_owners

SHAPES = [(32, 16), (16, 16), (48, 8), (8, 8), (24, 24)]


def test_owners_balance_the_elements_deterministically():
    sizes = [512, 256, 384, 64, 576]
    owners = assign_owners(sizes, 2)
    assert owners == assign_owners(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2)]
    assert loads == [896, 896]  # largest first: 576 -> 0, 512 -> 1, 384 -> 1, 256 -> 0, 64 -> 0
    assert assign_owners(sizes, 1) == [0] * 5
    assert set(assign_owners(sizes, 8)) == {0, 1, 2, 3, 4}  # more ranks than matrices: one each, the rest idle


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


OPTIONS = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    params = _params()
    opt = ShardedMuon(params, rank=rank, world_size=world, **OPTIONS)
    for step in range(3):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()  # DDP's all-reduce leaves every rank with the same gradients
        opt.step()
    state = opt.state_dict()["state"]
    torch.save(
        {
            "params": [p.detach() for p in params],
            "state_keys": sorted(state),
            "grads_kept": all(p.grad is not None for p in params),
        },
        f"{out}/rank{rank}.pt",
    )
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_equal_one_rank_of_torch_muon_and_shard_the_state(tmp_path):
    params = _params()
    reference = torch.optim.Muon(params, **OPTIONS)
    for step in range(3):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        reference.step()
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    owners = assign_owners([torch.Size(s).numel() for s in SHAPES], 2)
    for rank, result in enumerate(results):
        for p, q in zip(result["params"], params):
            torch.testing.assert_close(p, q.detach(), rtol=0, atol=1e-6)
        assert result["state_keys"] == [i for i, o in enumerate(owners) if o == rank]  # only its own buffers
        assert result["grads_kept"]
    assert not set(results[0]["state_keys"]) & set(results[1]["state_keys"])


def test_one_rank_is_torch_muon():
    a, b = _params(), _params()
    sharded, plain = ShardedMuon(a, **OPTIONS), torch.optim.Muon(b, **OPTIONS)
    for step in range(2):
        for p, q, g in zip(a, b, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        sharded.step()
        plain.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.parametrize("world", [2])
def test_a_full_state_dict_loads_into_a_shard(world):
    params = _params()
    full = torch.optim.Muon(params, **OPTIONS)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    full.step()
    shard = ShardedMuon(params, rank=1, world_size=world, **OPTIONS)
    shard.load_state_dict(full.state_dict())
    owners = assign_owners([p.numel() for p in params], world)
    assert sorted(shard.state_dict()["state"]) == [i for i, o in enumerate(owners) if o == 1]
