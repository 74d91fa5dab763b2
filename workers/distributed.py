"""The tensor-parallel group a model's layers talk through.

A ``TPGroup`` is a plain value: which rank this process is, how many ranks share the model, and the
``torch.distributed`` process group that connects them. Layers call ``all_reduce`` / ``all_gather`` on it and
never touch ``torch.distributed`` directly, so a size-1 group (the default) costs nothing and needs no
initialised process group.

Creating one for a worker whose process group is already initialised::

    dist.init_process_group("nccl", init_method=..., rank=rank, world_size=tp_size)
    tp = TPGroup.from_process_group()          # the default (world) group
    tp = TPGroup.from_process_group(subgroup)  # or a subgroup from dist.new_group(ranks)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None with size > 1: the default (world) group

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    @staticmethod
    def single() -> TPGroup:
        """No tensor parallelism: every collective is the identity."""
        return TPGroup(0, 1, None)

    @staticmethod
    def from_process_group(group: dist.ProcessGroup | None = None) -> TPGroup:
        """The group of an initialised ``torch.distributed`` process group (default: the world group)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first "
                               "(or use TPGroup.single() for one rank)")
        return TPGroup(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks. In place when size > 1; returns the reduced tensor."""
        if self.size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_int_lists(self, lists: list[list[int]] | None, count: int, device: torch.device | str = "cpu",
                            src: int = 0) -> list[list[int]]:
        """Rank ``src`` sends ``count`` lists of ints; every rank returns them (plain tensors, no pickle).

        Used for verification results: one rank verifies, every rank commits the same accepted paths.
        """
        if self.size == 1:
            assert lists is not None
            return lists
        if self.rank == src:
            assert lists is not None and len(lists) == count
            lengths = torch.tensor([len(x) for x in lists], dtype=torch.long, device=device)
        else:
            lengths = torch.empty(count, dtype=torch.long, device=device)
        dist.broadcast(lengths, src=self._global(src), group=self.group)
        total = int(lengths.sum())
        flat = (torch.tensor([v for x in lists for v in x], dtype=torch.long, device=device) if self.rank == src
                else torch.empty(total, dtype=torch.long, device=device))
        if total:
            dist.broadcast(flat, src=self._global(src), group=self.group)
        return [chunk.tolist() for chunk in flat.cpu().split(lengths.tolist())]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)
