"""Fixed-size KV-cache blocks: who owns which, how many are free, and which full blocks are
cached for other requests to share (automatic prefix caching).

A full block is named by a digest of its tokens chained with the digest of every block before it
(and a salt naming the model, and the request's cache scope), so two requests share a block only
when everything before it is the same too, and only within one scope: a caller of another scope
can neither read those K/V nor tell from its own speed that they are cached. Cached blocks are
shared by reference count; a block no request references stays cached, evictable, and the least
recently released is reused first when no block is free. Digests are SHA-256, not Python's hash: a
prefix whose digest collides with another user's would read that user's K/V, so the name must not
be forgeable.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict, deque

from .sequence import Sequence


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool = False, salt: str = ""
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._root = hashlib.sha256(f"tandem-prefix:{salt}".encode()).digest()
        self._block_bytes = struct.Struct(f"<{block_size}q")  # a full block's tokens, as hashed
        self._free: deque[int] = deque(range(num_blocks))  # hold nothing worth keeping
        self._refs = [0] * num_blocks
        self._digest: dict[int, bytes] = {}  # cached block -> its digest
        self._by_digest: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        # prompt tokens looked up at admission, and those found cached (Prometheus counters)
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Blocks a request can have now: free ones and cached ones nobody uses."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._digest)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def refs(self, block: int) -> int:
        return self._refs[block]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that `num_new_tokens` more tokens of `seq` have a slot."""
        total = seq.num_computed + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        self.grow(seq, self.blocks_needed(seq, num_new_tokens))

    def grow(self, seq: Sequence, n: int) -> None:
        """Give the sequence `n` more blocks (`blocks_needed`'s count, when the caller has it)."""
        if n == 0:
            return
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        for _ in range(n):
            block = self._take()
            self._refs[block] = 1
            seq.block_ids.append(block)

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)  # the least recently released cached block
        del self._by_digest[self._digest.pop(block)]
        return block

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; cached ones stay findable until their room is needed."""
        for block in seq.block_ids:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_ids = array("i")
        seq.block_epoch += 1
        seq.blocks_cached = 0

    def _chain(self, seq: Sequence, count: int) -> list[bytes]:
        """Digests of (at least) the sequence's first `count` full blocks (kept on it: each is
        made once)."""
        digests, bs = seq.block_digests, self.block_size
        while len(digests) < count:
            i = len(digests)
            parent = digests[-1] if digests else self._scope_root(seq.cache_scope)
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            digests.append(hashlib.sha256(parent + self._block_bytes.pack(*tokens)).digest())
        return digests

    def _scope_root(self, scope: bytes) -> bytes:
        """The digest a scope's chains start from (the shared scope: the model's root itself)."""
        return hashlib.sha256(self._root + scope).digest() if scope else self._root

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix, and mark
        those tokens computed; returns their number. At least one token is left to compute: its
        logits give the next token."""
        if not self.prefix_caching or seq.block_ids or seq.num_computed:
            return 0
        most = (seq.length - 1) // self.block_size
        if (needed := seq.prompt_logprobs_from) is not None:  # positions whose logits it needs are computed
            most = min(most, needed // self.block_size)
        seq.num_computed = self._share_cached(seq, most) * self.block_size
        self.queried_tokens += seq.length
        self.hit_tokens += seq.num_computed
        return seq.num_computed

    def held_elsewhere(self, seq: Sequence, count: int) -> int:
        """How many of the sequence's first `count` blocks, in a row, are cached and held by another
        sequence too: they stay findable while it holds them (an offloaded sequence leaves them)."""
        n = 0
        for block in seq.block_ids[: min(count, seq.blocks_cached)]:
            if self._refs[block] < 2 or block not in self._digest:
                break
            n += 1
        return n

    def share_restored(self, seq: Sequence) -> int:
        """An offloaded sequence coming back, with no device blocks and its K/V in the host pool:
        give it the cached blocks of its computed K/V's longest cached prefix (often its own, still
        cached since it left), which then need no copy in; returns how many. Not a prompt lookup:
        the hit counters do not count it."""
        if not self.prefix_caching or seq.block_ids:
            return 0
        return self._share_cached(seq, seq.num_computed // self.block_size)

    def _share_cached(self, seq: Sequence, count: int) -> int:
        """Give a sequence with no blocks the cached blocks of its first `count` full blocks, as far
        as they are cached in a row; returns how many it got."""
        blocks = []
        for digest in self._chain(seq, count)[:count]:
            block = self._by_digest.get(digest)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_ids = array("i", blocks)
        seq.blocks_cached = len(blocks)
        return len(blocks)

    def unmatch(self, seq: Sequence, matched: int) -> None:
        """Undo a match_prefix whose sequence could not be admitted after all: the blocks it gave,
        and its lookup in the counters, hit or not (the sequence is looked up again each step it
        waits; counted once, when admitted)."""
        if not self.prefix_caching:
            return
        if matched:
            self.free(seq)
            seq.num_computed = 0
        self.queried_tokens -= seq.length
        self.hit_tokens -= matched

    def cache_computed(self, seq: Sequence, upto: int) -> None:
        """The K/V of the sequence's positions below `upto` are written: make its full blocks there
        findable. A block whose content another block already holds stays the sequence's own."""
        if not self.prefix_caching:
            return
        full = min(upto // self.block_size, len(seq.block_ids))
        if full <= seq.blocks_cached:  # a decode step that filled no block: nothing new (the common case)
            return
        digests = self._chain(seq, full)
        for i in range(seq.blocks_cached, full):
            block, digest = seq.block_ids[i], digests[i]
            if block not in self._digest and digest not in self._by_digest:
                self._digest[block] = digest
                self._by_digest[digest] = block
        seq.blocks_cached = full
