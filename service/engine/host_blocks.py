"""The host pool's bookkeeping: which of its blocks hold a preempted sequence's K/V.

Preemption copies a sequence's KV blocks to the pool instead of dropping them; its blocks come back
to the device before it runs again (kv_offload.py makes the copies); leading blocks it shares in the
prefix cache with a sequence still running stay on the device, uncopied (ON_DEVICE). Only
bookkeeping lives here, so the scheduler stays free of tensors. Blocks are handed out lowest id
first, so a sequence's blocks are mostly one run of the pool and its copies few.

A pool pinned in the background (kv_offload.py) starts closed: no block is free until the memory
exists and the engine core opens it; until then a preempted sequence is recomputed.
"""

from __future__ import annotations

import heapq

# a sequence's host_blocks entry for a block not copied out: it stayed cached on the device, shared
# with a sequence still running, and is shared again when it comes back
ON_DEVICE = -1


class HostBlocks:
    def __init__(self, num_blocks: int, is_open: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the host pool needs at least one block")
        self.num_blocks = num_blocks
        self.is_open = False
        self._free: list[int] = []  # a heap: lowest id first
        if is_open:
            self.open()

    def open(self) -> None:
        """Every block free: the pool's memory exists (once; the pool is never closed again)."""
        if not self.is_open:
            self.is_open = True
            self._free = list(range(self.num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks if self.is_open else 0.0

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} host KV blocks, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block != ON_DEVICE:
                heapq.heappush(self._free, block)
