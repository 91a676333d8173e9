"""Fixed-size KV-cache blocks: who owns which, and how many are free."""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that `num_new_tokens` more tokens of `seq` have a slot."""
        total = seq.num_computed + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        n = self.blocks_needed(seq, num_new_tokens)
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        seq.block_ids.extend(self._free.popleft() for _ in range(n))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_ids)
        seq.block_ids = []
