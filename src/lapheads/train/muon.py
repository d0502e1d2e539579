"""Muon with its work split across DDP ranks, as nanochat's DistMuon does, on top of ``torch.optim.Muon``'s math.

After DDP's all-reduce every rank holds the same gradients, so running the whole Muon update (a Newton-Schulz
orthogonalisation per matrix) on every rank repeats the same work world-size times. Here each matrix has one owner
rank: the owner keeps its momentum buffer and updates it; then every rank receives the new values of the matrices it
does not own, one broadcast per owner.

Design choices:

* **torch.optim.Muon does the math.** ``ShardedMuon`` is a ``torch.optim.Muon`` whose ``step`` hides the gradients of
  the matrices this rank does not own (Muon skips parameters without a gradient) and then broadcasts. Learning-rate,
  momentum and weight-decay schedules keep writing ``param_groups`` as for the plain optimizer.
* **Owners balance the work**: matrices are assigned largest first to the rank with the fewest elements so far
  (Newton-Schulz costs grow with the matrix), deterministically, so every rank computes the same assignment.
* **State is sharded**: a rank's ``state_dict`` holds only its own momentum buffers (1/world of the total);
  checkpoints write one file per rank (``sharded = True`` tells ``save_checkpoint``), and resuming needs the same
  world size, which lapheads requires anyway.
* One rank (``world_size == 1``) is exactly ``torch.optim.Muon``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from lapheads.distributed import peer_failures

__all__ = ["ShardedMuon", "assign_owners"]


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """An owner rank per matrix: largest first, each to the least-loaded rank (ties: the lowest rank)."""
    load = [0] * world_size
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += sizes[index]
    return owners


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose updates are computed by one owner rank per matrix and broadcast.

    Args:
        params: the matrices (or param groups), as for ``torch.optim.Muon``.
        rank, world_size: this process and the job size (``lapheads.distributed.Distributed``).
        **kwargs: ``torch.optim.Muon``'s options (lr, momentum, nesterov, weight_decay, ...).
    """

    sharded = True  # save_checkpoint writes one optimizer file per rank

    def __init__(self, params: Iterable, *, rank: int = 0, world_size: int = 1, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.rank, self.world_size = rank, world_size
        self._params = [p for group in self.param_groups for p in group["params"]]
        owners = assign_owners([p.numel() for p in self._params], world_size)
        self._owner = {p: owner for p, owner in zip(self._params, owners)}
        self._owned_by = [[p for p in self._params if self._owner[p] == r] for r in range(world_size)]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a shard, or the full state of an unsharded Muon (an older checkpoint): only this rank's buffers stay."""
        super().load_state_dict(state_dict)
        for p in self._params:
            if self._owner[p] != self.rank:
                self.state.pop(p, None)

    @torch.no_grad()
    def step(self, closure=None):
        if self.world_size == 1:
            return super().step(closure)
        hidden = {}
        for p in self._params:
            if self._owner[p] != self.rank and p.grad is not None:
                hidden[p], p.grad = p.grad, None
        try:
            loss = super().step(closure)
        finally:
            for p, grad in hidden.items():
                p.grad = grad
        with peer_failures():
            for owner, params in enumerate(self._owned_by):
                if not params:
                    continue
                flat = torch.cat([p.reshape(-1) for p in params])  # owner: the new values; others: overwritten
                dist.broadcast(flat, src=owner)
                if owner != self.rank:
                    for p, values in zip(params, flat.split([p.numel() for p in params])):
                        p.copy_(values.view_as(p))
        return loss
