"""KV block accounting for one cache (pure Python; the tensors live in the worker).

A sequence owns a block table. ``reserve`` grows it to cover the committed tokens plus this round's scratch
nodes; ``trim`` gives back the blocks past the committed length once the round is committed; ``free`` releases
everything when the request finishes or is preempted.

The lowest free block is handed out first (a heap, not a stack). A sequence's blocks then lie in ascending runs
wherever the pool has them, and the attention's gather of its context reads memory in order. Handed out in the
order they were freed, the blocks of a pool that had served many sequences (the adaptive policy's start-up
profiling runs up to 64 at once) came out scattered, and every later draft and target forward was 5-20 % slower
than on a fresh pool (built-in pair, batch 1, chain of 4: 10.2 vs 8.4 ms per draft call, 13.5 vs 12.8 per
verify, measured side by side).

Prefix caching (``enable_caching``; scheduler/prefix_cache.py names the blocks): a full, committed block can be
``register``-ed under its hash; another sequence whose prefix hashes alike starts its table with it
(``attach``). Blocks are reference-counted: a block in several tables is released when the last one lets go.
A released cached block keeps its K/V and its hash and waits in LRU order (*evictable*); it counts as free and
is reused, losing its hash, only when the heap of never-cached free blocks is empty. So cached blocks cost a
request nothing: they are evicted before anyone is refused or preempted.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from scheduler.prefix_cache import BlockHash


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 namespace: bytes = b"") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.namespace = namespace  # the model this pool caches: part of every key, so pools never mix
        self._free: list[int] = list(range(num_blocks))  # a heap: the lowest free block first
        self.tables: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}  # block -> tables holding it (blocks in use only)
        self._cached: dict[BlockHash, int] = {}  # namespaced hash -> block
        self._hash_of: dict[int, BlockHash] = {}  # block -> its key in _cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, in no table; least recently used first
        self._registered: dict[int, int] = {}  # seq_id -> leading blocks of its table already offered

    @property
    def num_free(self) -> int:
        """Blocks a reservation can take: never-cached free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_needed(self, seq_id: int, num_slots: int) -> int:
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-num_slots // self.block_size) - have)

    def can_reserve(self, seq_id: int, num_slots: int) -> bool:
        return self.blocks_needed(seq_id, num_slots) <= self.num_free

    def reserve(self, seq_id: int, num_slots: int) -> list[int]:
        """Make the table cover ``num_slots`` slots; raises MemoryError if the pool is short."""
        need = self.blocks_needed(seq_id, num_slots)
        if need > self.num_free:
            raise MemoryError(f"need {need} KV blocks, {self.num_free} free")
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            block = heapq.heappop(self._free) if self._free else self._evict()
            self._refs[block] = 1
            table.append(block)
        return table

    def trim(self, seq_id: int, num_slots: int) -> None:
        """Release blocks past the first ``num_slots`` slots (scratch no longer needed)."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = -(-num_slots // self.block_size)
        while len(table) > keep:
            self._release(table.pop())
        self._registered[seq_id] = min(self._registered.get(seq_id, 0), len(table))

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        self._registered.pop(seq_id, None)
        # The tail first: the LRU order then evicts a sequence's last blocks before its first, which more
        # requests share (vLLM frees in the same order for the same reason).
        for block in reversed(table or ()):
            self._release(block)

    # ------------------------------------------------------------------------------------------ prefix caching
    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the leading ``hashes`` this pool holds, in order (0 when caching is off)."""
        if not self.enable_caching:
            return 0
        n = 0
        for h in hashes:
            if self.namespace + h not in self._cached:
                break
            n += 1
        return n

    def attach(self, seq_id: int, hashes: Sequence[BlockHash]) -> None:
        """Start ``seq_id``'s (empty) table with the cached blocks of ``hashes`` (all must ``match``)."""
        if self.tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already holds blocks: a cached prefix starts a table")
        table = self.tables.setdefault(seq_id, [])
        for h in hashes:
            block = self._cached[self.namespace + h]
            refs = self._refs.get(block, 0)
            if refs == 0:
                del self._evictable[block]
            self._refs[block] = refs + 1
            table.append(block)
        self._registered[seq_id] = len(table)

    def register(self, seq_id: int, hashes: Sequence[BlockHash], num_blocks: int) -> None:
        """The first ``num_blocks`` blocks of ``seq_id``'s table (named by ``hashes``) are full and committed:
        cache them by hash.

        A hash already cached under another block (two requests computed the same prefix at once) keeps the
        first block; the duplicate stays private and is freed as usual."""
        if not self.enable_caching:
            return
        table = self.tables.get(seq_id, [])
        done, upto = self._registered.get(seq_id, 0), min(num_blocks, len(hashes), len(table))
        for i in range(done, upto):
            key, block = self.namespace + hashes[i], table[i]
            if block not in self._hash_of and key not in self._cached:
                self._cached[key] = block
                self._hash_of[block] = key
        self._registered[seq_id] = max(done, upto)

    def drop_cache(self) -> None:
        """Forget every hash: the worker's cache was lost (engine/execution/recovery.py), nothing in it is valid."""
        self._cached.clear()
        self._hash_of.clear()
        for block in self._evictable:
            heapq.heappush(self._free, block)
        self._evictable.clear()
        # The blocks tables hold now are never offered again: their content came from the lost cache.
        self._registered = {seq_id: len(table) for seq_id, table in self.tables.items()}

    def _release(self, block: int) -> None:
        refs = self._refs.pop(block) - 1
        if refs > 0:
            self._refs[block] = refs
        elif block in self._hash_of:
            self._evictable[block] = None  # most recently used last
        else:
            heapq.heappush(self._free, block)

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._hash_of.pop(block)]
        return block
