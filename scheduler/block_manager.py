"""KV block accounting for one cache (pure Python; the tensors live in the worker).

A sequence owns a block table. ``reserve`` grows it to cover the committed tokens plus this round's scratch
nodes; ``trim`` gives back the blocks past the committed length once the round is committed; ``free`` releases
everything when the request finishes or is preempted.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end; reversed so block 0 is handed out first (easier to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq_id: int, num_slots: int) -> int:
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-num_slots // self.block_size) - have)

    def can_reserve(self, seq_id: int, num_slots: int) -> bool:
        return self.blocks_needed(seq_id, num_slots) <= len(self._free)

    def reserve(self, seq_id: int, num_slots: int) -> list[int]:
        """Make the table cover ``num_slots`` slots; raises MemoryError if the pool is short."""
        need = self.blocks_needed(seq_id, num_slots)
        if need > len(self._free):
            raise MemoryError(f"need {need} KV blocks, {len(self._free)} free")
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._free.pop())
        return table

    def trim(self, seq_id: int, num_slots: int) -> None:
        """Release blocks past the first ``num_slots`` slots (scratch no longer needed)."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = -(-num_slots // self.block_size)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        if table:
            self._free.extend(reversed(table))
