"""Continuous batching: which sequences run in the next step, and how many tokens each.

Policy per step, under a token budget and a cap on running sequences:
1. decode first: every running sequence with one token to compute gets it;
2. then running sequences still in (chunked) prefill get what is left of the budget;
3. then waiting sequences are admitted in FIFO order while budget and blocks last (blocks for all
   a sequence has left to compute, though a step computes a chunk of it); with prefix caching a
   sequence admitted starts from the cached blocks of its longest cached prefix.
When a running sequence needs a block and none is free, the most recently admitted sequence
not yet scheduled this step is preempted: with a host pool that has room, its K/V are copied out
to the pool (offloaded) and copied back before it runs again, at the head of the queue; otherwise
its blocks are freed and it is recomputed later from its tokens. With prefix caching, the leading
blocks it shares with a sequence still running are not copied out, and the leading blocks still
cached on the device when it comes back are shared instead of copied in; one it left that is gone
by then (evicted once nobody held it) makes it recomputed from there.
A sequence that cannot be scheduled even then preempts itself; the others finish and free blocks,
so the engine never deadlocks (a request never needs more blocks than the cache has: validated).

Failure containment: the sequences of a step that failed are quarantined (their blocks freed, to be
recomputed from their tokens, after the prefix they find cached) and then run one at a time, alone
in their steps, until each has its next token; one whose lone step fails again is the culprit (the
engine core fails it). Meanwhile nothing else is scheduled, so a failure is always pinned on the
request that caused it.

Prefix caching: a chunk's full blocks become findable when its step's tokens come back
(finish_step), never at scheduling, so no step reads a shared block that a step beside it is still
writing; a chunk whose sequence lost its blocks meanwhile (preempted, aborted) caches nothing.

Offload: a step's block copies (SchedulerOutput.moves) are queued before its forward, so copies out
read what the steps before wrote and copies in land before this step reads them. A host block is
free again as soon as its copy in is queued: every copy to or from the pool runs in one queue, so a
later copy out to that block comes after it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .host_blocks import ON_DEVICE, HostBlocks
from .sequence import FinishReason, Sequence


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step
    num_tokens: int

    samples: bool = False  # does this chunk end at the sequence's last token (and so produce one)?
    carried: bool = False  # is its input the token the previous, still running step samples?
    epoch: int = 0  # the sequence's block_epoch when scheduled: its blocks are the same while equal


@dataclass
class BlockMoves:
    """K/V copies between the device cache and the host pool, queued before the step's forward."""

    out_device: list[int] = field(default_factory=list)  # device blocks copied out ...
    out_host: list[int] = field(default_factory=list)  # ... to these host blocks
    in_host: list[int] = field(default_factory=list)  # host blocks copied in ...
    in_device: list[int] = field(default_factory=list)  # ... to these device blocks

    def __bool__(self) -> bool:
        return bool(self.out_device or self.in_host)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]
    moves: BlockMoves = field(default_factory=BlockMoves)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        host: HostBlocks | None = None,
    ) -> None:
        self.blocks = blocks
        self.host = host  # the host pool preempted sequences' K/V go to (None: recompute them)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.suspects: deque[Sequence] = deque()  # quarantined after a failed step, run alone in turn
        # since start: preemptions by what became of the sequence's K/V, blocks copied each way,
        # blocks an offloaded sequence found still cached on the device (copied out, not copied
        # back), and blocks it left there uncopied (shared with a sequence still running)
        self.preempted_offload = 0
        self.preempted_recompute = 0
        self.blocks_offloaded = 0
        self.blocks_restored = 0
        self.blocks_reused = 0
        self.blocks_kept = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.suspects)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its blocks; call between steps."""
        for queue in (self.running, self.waiting, self.suspects):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._release(seq)
                    seq.finish_reason = FinishReason.CANCELLED
                    return seq
        return None

    def quarantine(self, seqs: list[Sequence]) -> None:
        """The sequences of a failed step (nothing is in flight any more): recompute each alone."""
        for seq in seqs:
            for queue in (self.running, self.waiting, self.suspects):
                if seq in queue:
                    queue.remove(seq)
            self._release(seq)
            seq.num_computed = seq.num_inflight = 0
            seq.prompt_logprobs_next = len(seq.prompt_logprobs)  # a failed step's are computed again
            self.suspects.append(seq)

    def _schedule_alone(self, seq: Sequence) -> SchedulerOutput:
        """The first suspect's next chunk, alone in its step; room made by preempting running ones.
        Its first starts after its longest cached prefix: often its own blocks, which quarantine
        left cached (a failed step's writes are never cached)."""
        out = SchedulerOutput([], [])
        if seq.num_uncomputed == 0 or seq.will_finish_by_length:
            return out  # its token is in flight: wait for it
        self.blocks.match_prefix(seq)  # nothing once it holds blocks
        n = min(seq.num_uncomputed, self.max_num_batched_tokens)
        while not self.blocks.can_allocate(self.blocks.blocks_needed(seq, n)) and self.running:
            self._preempt(self.running[-1], out)
        self.blocks.allocate(seq, n)
        samples = seq.num_computed + n == seq.length
        chunk = ScheduledChunk(seq, seq.num_computed, n, samples, seq.num_inflight > 0, seq.block_epoch)
        seq.num_computed += n
        seq.num_inflight += samples
        out.chunks.append(chunk)
        return out

    def schedule(self) -> SchedulerOutput:
        if self.suspects:
            return self._schedule_alone(self.suspects[0])
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], [])
        chunks = out.chunks
        blocks = self.blocks
        scheduled: set[int] = set()
        preempted: set[int] = set()  # by this call (ids): they left `running`

        def take(seq: Sequence, n: int, need: int) -> None:
            """Schedule `n` tokens of `seq`, which needs `need` more blocks for them (blocks_needed)."""
            nonlocal budget
            if need:
                blocks.grow(seq, need)
            start = seq.num_computed
            samples = start + n == seq.length
            chunks.append(ScheduledChunk(seq, start, n, samples, seq.num_inflight > 0, seq.block_epoch))
            seq.num_computed = start + n  # claimed now, so a step scheduled before this one ends sees it
            seq.num_inflight += samples
            scheduled.add(id(seq))
            budget -= n

        def make_room(seq: Sequence, need: int) -> bool:
            """Preempt from the tail until `need` blocks are free for `seq`; False if `seq` itself
            had to go."""
            while not blocks.can_allocate(need):
                victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
                self._preempt(victim, out)
                preempted.add(id(victim))
                if victim is seq:
                    return False
            return True

        decoding: list[tuple[Sequence, int]] = []  # (sequence, tokens it has left to compute)
        prefilling: list[tuple[Sequence, int]] = []
        for seq in self.running:
            left = seq.num_uncomputed
            if left and not seq.will_finish_by_length:
                (decoding if left == 1 else prefilling).append((seq, left))
        for seq, left in decoding + prefilling:
            if budget == 0:
                break
            if id(seq) in preempted:  # earlier in this loop
                continue
            n = min(left, budget)
            need = blocks.blocks_needed(seq, n)  # most decodes need none
            if need and not make_room(seq, need):
                continue
            take(seq, n, need)

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_inflight:  # preempted while its last token is in flight: wait for it
                break
            shared = self._share_restored(seq) if seq.host_blocks else 0
            matched = self.blocks.match_prefix(seq)  # nothing for an offloaded one: it has its K/V
            n = min(seq.num_uncomputed, budget)
            # room for all it has to compute, not only this step's chunk: admitted without it, its
            # prompt (or recomputed context) is preempted before it is done, again and again
            if not self.blocks.can_allocate(self.blocks.blocks_needed(seq, seq.num_uncomputed)):
                if seq.host_blocks:  # not looked up (it keeps its K/V): what share_restored gave goes back
                    self.blocks.free(seq)
                else:
                    self.blocks.unmatch(seq, matched)
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(seq)
            if seq.cached_tokens is None:  # its first admission: what its usage reports
                seq.cached_tokens = matched
            take(seq, n, self.blocks.blocks_needed(seq, n))
            if seq.host_blocks:
                self._restore(seq, shared, out.moves)
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take a running sequence off the device (its blocks are free for this step): its K/V to
        the host pool where there is room, else dropped (recomputed later from its tokens). One whose
        token in flight ends it never runs again: its K/V are dropped, not copied out."""
        self.running.remove(seq)
        held = -(-seq.num_computed // self.blocks.block_size)  # the blocks holding its computed K/V
        kept = self.blocks.held_elsewhere(seq, held)  # stay cached on the device: not copied
        if seq.will_finish_by_length:  # not counted: its request is done once that token is back
            seq.num_computed = 0
        elif self.host is not None and held and self.host.can_allocate(held - kept):
            # it keeps num_computed: its K/V come back
            seq.host_blocks = [ON_DEVICE] * kept + self.host.allocate(held - kept)
            out.moves.out_device += seq.block_ids[kept:held]
            out.moves.out_host += seq.host_blocks[kept:]
            self.blocks_offloaded += held - kept
            self.blocks_kept += kept
            self.preempted_offload += 1
        else:
            seq.num_computed = 0
            self.preempted_recompute += 1
        # a step still running may write these blocks, and the copy out reads them: both are queued
        # before any later step that writes them
        self.blocks.free(seq)
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _share_restored(self, seq: Sequence) -> int:
        """An offloaded sequence at the head of the queue: share the leading blocks of its K/V still
        cached on the device (they need no copy in); returns how many. If one it left on the device
        is gone (evicted once nobody held it), it is recomputed from there instead: its pool blocks
        are freed and its lookup is a recomputed sequence's (match_prefix)."""
        shared = self.blocks.share_restored(seq)
        if ON_DEVICE not in seq.host_blocks[shared:]:
            return shared
        self._release(seq)
        seq.num_computed = 0
        return 0

    def _restore(self, seq: Sequence, shared: int, moves: BlockMoves) -> None:
        """An offloaded sequence got its device blocks back, the first `shared` from the prefix
        cache (at least those it left there, ON_DEVICE): copy the rest of its K/V in before this
        step reads them."""
        held = len(seq.host_blocks)
        moves.in_host += seq.host_blocks[shared:]
        moves.in_device += seq.block_ids[shared:held]
        self.blocks_restored += held - shared
        self.blocks_reused += shared - seq.host_blocks.count(ON_DEVICE)
        self._release_host(seq)  # later copies to these blocks queue after this one

    def _release(self, seq: Sequence) -> None:
        """Free whatever blocks a sequence holds, on the device and in the host pool."""
        self.blocks.free(seq)
        self._release_host(seq)

    def _release_host(self, seq: Sequence) -> None:
        if seq.host_blocks:
            assert self.host is not None
            self.host.free(seq.host_blocks)
            seq.host_blocks = []

    def finish_step(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[int]:
        """Hand the step's new tokens (chunk index -> token) to their sequences; returns the
        indices of the chunks whose sequence took its token, in order (finished ones included).

        A sequence that finished in an earlier step but was already scheduled in this one (the
        asynchronous loop schedules ahead) gets nothing: its extra token is dropped.
        """
        took = []
        blocks = self.blocks
        block_size = blocks.block_size if blocks.prefix_caching else 0
        for i, chunk in enumerate(out.chunks):
            seq = chunk.seq
            upto = chunk.start + chunk.num_tokens
            # its K/V are written and its blocks still its own; most decodes fill no block
            if block_size and chunk.epoch == seq.block_epoch and upto // block_size > seq.blocks_cached:
                blocks.cache_computed(seq, upto)
            token = sampled.get(i)
            if token is None or seq.finish_reason is not None:  # no token, or aborted / done meanwhile
                continue
            seq.num_inflight -= 1
            seq.append(token)
            took.append(i)
            if self.suspects and seq is self.suspects[0]:  # its lone step went through: cleared
                self.suspects.popleft()
                self.running.append(seq)
            if seq.finish_reason is not None:
                queue = self.running if seq in self.running else self.waiting
                queue.remove(seq)
                self._release(seq)
        return took
