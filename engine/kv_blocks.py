"""The paged KV cache's block allocator: pure bookkeeping, no tinygrad (the headless coordinator imports it).

A stage's KV pool is `n_blocks` blocks of `block_size` positions. A sequence (a KV slot) owns a block table: its
positions [i * block_size, (i + 1) * block_size) live in block table[i]. Blocks are handed out as a sequence grows
and come back when its slot is cleared, so memory follows the lengths actually held, not slots x max_context.

Who allocates (NOTES.md, "Paged KV cache"): the coordinator's scheduler runs one `BlockPool` sized to the smallest
pool of the chain's stages (each stage reports its pool in Info) and sends each changed table in-band as
BlockTable(slot, blocks) ahead of the step that needs it; every stage applies it (`Stage.block_table`), which runs
the same `BlockPool.assign` on the stage's own pool and so refuses a block that another slot holds. A stage driven
without tables (the engine on its own, tests, benches) grows its tables itself with `ensure`, lowest free block
first: driven by the same steps, every stage then holds the same tables.
"""
from __future__ import annotations

import heapq
import os
from collections.abc import Iterable

from .errors import EngineError, RangeError

# positions per block: small enough that a sequence wastes at most 15 positions a layer, large enough that a table
# stays short (2048 positions: 128 entries) and a block's rows are contiguous runs for the attention kernels
BLOCK_SIZE = 16


KV_BYTES = {"f16": 2, "f32": 4}  # the KV pools' types, by the bytes of one value


def kv_type_for(device: str) -> str:
    """The KV pools' type of a stage on `device` that is not told one: $MESH_KV_DTYPE (f16 or f32), else f16 on a CPU
    device (as llama.cpp keeps its KV cache: half the memory and half the bytes attention reads from DRAM each step,
    which bound the CPU's batched decode step; NOTES "KV in f16 on the CPU") and f32 on GPUs (not measured there).
    Here, without tinygrad, because a peer reports the bytes of its KV values to the coordinator's planner (Info)."""
    env = os.environ.get("MESH_KV_DTYPE")
    if env:
        if env not in KV_BYTES:
            raise EngineError(f"MESH_KV_DTYPE={env!r}: expected f16 or f32")
        return env
    return "f16" if device.startswith("CPU") else "f32"


class PoolFull(RangeError):
    """The pool has fewer free blocks than a sequence needs to grow (nothing was allocated)."""


def blocks_for(length: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold `length` positions."""
    return -(-max(length, 0) // block_size)


class BlockPool:
    """Which slot owns which block. Deterministic: `ensure` takes the lowest free blocks, so two pools driven by the
    same calls hold the same tables."""

    def __init__(self, n_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if n_blocks < 1 or block_size < 1:
            raise RangeError(f"a KV pool needs at least one block of at least one position, got {n_blocks} x "
                             f"{block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free = list(range(n_blocks))  # a heap: lowest block first
        self._owner: dict[int, int] = {}  # block -> slot
        self._tables: dict[int, list[int]] = {}  # slot -> its blocks in position order

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return len(self._owner)

    def table(self, slot: int) -> tuple[int, ...]:
        return tuple(self._tables.get(slot, ()))

    def capacity(self, slot: int) -> int:
        """Positions the slot's blocks hold."""
        return len(self._tables.get(slot, ())) * self.block_size

    def needed(self, slot: int, length: int) -> int:
        """Blocks the slot must still get to hold `length` positions."""
        return max(0, blocks_for(length, self.block_size) - len(self._tables.get(slot, ())))

    def ensure(self, slot: int, length: int) -> tuple[int, ...] | None:
        """Grow the slot's table to hold `length` positions. Returns the new table, or None when it already held
        them. Raises PoolFull (and allocates nothing) when too few blocks are free."""
        need = self.needed(slot, length)
        if need == 0:
            return None
        if need > len(self._free):
            raise PoolFull(f"KV pool full: slot {slot} needs {need} more blocks of {self.block_size} positions for "
                           f"{length} positions, {len(self._free)} of {self.n_blocks} are free")
        table = self._tables.setdefault(slot, [])
        for _ in range(need):
            b = heapq.heappop(self._free)
            self._owner[b] = slot
            table.append(b)
        return tuple(table)

    def assign(self, slot: int, blocks: Iterable[int]) -> None:
        """Make `blocks` the slot's table (a table sent by whoever allocates for the chain). Blocks it no longer
        lists are freed; a block outside the pool, listed twice or held by another slot is refused (nothing
        changes)."""
        blocks = [int(b) for b in blocks]
        seen: set[int] = set()
        for b in blocks:
            if not 0 <= b < self.n_blocks:
                raise RangeError(f"block table of slot {slot}: block {b} is outside the pool [0, {self.n_blocks})")
            if b in seen:
                raise RangeError(f"block table of slot {slot}: block {b} is listed twice")
            seen.add(b)
            owner = self._owner.get(b)
            if owner is not None and owner != slot:
                raise RangeError(f"block table of slot {slot}: block {b} belongs to slot {owner}")
        self.free(slot)
        for b in blocks:
            self._owner[b] = slot
        self._free = [b for b in self._free if b not in seen]
        heapq.heapify(self._free)
        if blocks:
            self._tables[slot] = blocks

    def free(self, slot: int) -> int:
        """Give the slot's blocks back; returns how many."""
        table = self._tables.pop(slot, [])
        for b in table:
            del self._owner[b]
            heapq.heappush(self._free, b)
        return len(table)

    def reset(self) -> None:
        self._free = list(range(self.n_blocks))
        self._owner.clear()
        self._tables.clear()
