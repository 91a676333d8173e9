"""The scheduler, block manager and host pool driven by a hypothesis state machine, as the engine's
asynchronous loop drives them: step N+1 is scheduled before step N's tokens come back, requests
arrive and are aborted between steps, failed steps are contained (quarantine, culprits failed),
with prefix caching, several cache scopes, a small device cache and a small host pool.

No model runs: the test plays the device. Each step "runs" when it is scheduled (the device runs
steps, and their block copies, in the order they are queued): its copies move the shadow contents
of blocks, its chunks write the K/V of their positions and read all their context. A slot's content
names what its K/V were computed from (the scope and every token up to it, in-flight tokens
included), so a block handed to the wrong sequence, evicted while in use, copied to the wrong place
or cached under the wrong digest is read back as the wrong content. The tokens a step samples are
chosen when it is scheduled and handed over when it finishes.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.service.contract import FinishReason, Request, SamplingParams
from tandem.service.engine.block_manager import BlockManager
from tandem.service.engine.engine_core import MAX_FAILED_STEPS
from tandem.service.engine.host_blocks import ON_DEVICE, HostBlocks
from tandem.service.engine.scheduler import Scheduler, SchedulerOutput
from tandem.service.engine.sequence import Sequence

VOCAB = 6  # small, so that prompts and outputs often share blocks beyond the shared prefixes
STOP = 99
SCOPES = (b"", b"tenant-a", b"tenant-b")
REQUESTS = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.integers(0, 12),  # how much of it
    st.lists(st.integers(0, VOCAB - 1), max_size=10),  # the prompt's own tokens
    st.sampled_from(SCOPES),
    st.integers(1, 24),  # max_tokens
    st.sampled_from([frozenset(), frozenset({STOP}), frozenset({STOP, 0})]),
)
TOKENS = st.integers(0, VOCAB).map(lambda t: STOP if t == VOCAB else t)  # a stop token now and then

Key = tuple[bytes, tuple[int, ...]]  # what a slot's K/V were computed from: scope, tokens up to it
Slot = tuple[Key, int] | None  # (content, the step that wrote it), or never written


@dataclass
class Step:
    """A launched step: its scheduler output, its id, the token each sampling chunk will get."""

    out: SchedulerOutput
    id: int
    tokens: dict[int, int] = field(default_factory=dict)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 12),
        block_size=st.sampled_from([2, 4]),
        host_blocks=st.integers(1, 10),
        max_num_seqs=st.integers(1, 5),
        budget=st.integers(2, 20),
    )
    def build(
        self, num_blocks: int, block_size: int, host_blocks: int, max_num_seqs: int, budget: int
    ) -> None:
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=True)
        self.host = HostBlocks(host_blocks)
        self.s = Scheduler(self.blocks, max_num_seqs, budget, host=self.host)
        self.bs = block_size
        self.capacity = num_blocks * block_size  # the context length (validation's bound)
        self.prefixes = [[(3 * i + 2 * j) % VOCAB for j in range(3 * block_size)] for i in range(3)]
        self.seqs: dict[str, Sequence] = {}
        self.handed: dict[str, list[int]] = {}  # tokens each sequence took, in order
        self.pending: dict[str, deque[int]] = {}  # tokens chosen for it by launched steps, in order
        self.inflight: deque[Step] = deque()
        self.steps = 0
        self.failed_steps: set[int] = set()  # what they wrote is garbage
        self.device: list[list[Slot]] = [[None] * block_size for _ in range(num_blocks)]
        self.pool: list[list[Slot]] = [[None] * block_size for _ in range(host_blocks)]
        self.digest_content: dict[bytes, Key] = {}  # a digest names one content, always

    # --- the model of the device --------------------------------------------------------------

    def virtual_tokens(self, seq: Sequence) -> list[int]:
        """Its tokens as the device sees them: those handed over, then those still in flight."""
        return seq.token_ids + list(self.pending[seq.request_id])

    def key(self, seq: Sequence, tokens: list[int], pos: int) -> Key:
        return seq.cache_scope, tuple(tokens[: pos + 1])

    def holds(self, slot: Slot, key: Key) -> bool:
        return slot is not None and slot[0] == key and slot[1] not in self.failed_steps

    def run_on_device(self, step: Step) -> None:
        """What the device does with a step, in queue order: its copies, then each chunk's K/V
        written and its context read; then the tokens its sampling chunks will get are chosen."""
        moves, bs = step.out.moves, self.bs
        assert len(moves.out_device) == len(moves.out_host) and len(moves.in_host) == len(moves.in_device)
        for d, h in zip(moves.out_device, moves.out_host, strict=True):
            self.pool[h] = list(self.device[d])
        for h, d in zip(moves.in_host, moves.in_device, strict=True):
            self.device[d] = list(self.pool[h])
        prev = self.inflight[-1] if self.inflight else None
        chunks = step.out.chunks
        assert step.out.num_tokens <= self.s.max_num_batched_tokens
        assert len({id(c.seq) for c in chunks}) == len(chunks), "a sequence twice in one step"
        alone = self.s.suspects[0] if self.s.suspects and len(chunks) == 1 else None
        for c in chunks:  # a step's sequences are on the device now (a suspect runs alone)
            assert c.seq in self.s.running or c.seq is alone, c.seq.request_id
        for chunk in step.out.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            rid = seq.request_id
            assert not seq.finished, f"{rid} scheduled after it finished"
            tokens = self.virtual_tokens(seq)
            assert n > 0 and start + n <= len(tokens), (rid, start, n, len(tokens))
            assert chunk.samples == (start + n == len(tokens)), rid
            if chunk.carried:  # its last input is the token the step before samples for it
                assert prev is not None and start + n - 1 == len(seq.token_ids), rid
                assert any(c.seq is seq and c.samples for c in prev.out.chunks), rid
            else:
                assert start + n <= len(seq.token_ids), f"{rid} computes a token it does not have"
            assert len(seq.block_ids) * bs >= start + n, f"{rid} has no slot for its K/V"
            for pos in range(start, start + n):
                self.device[seq.block_ids[pos // bs]][pos % bs] = (self.key(seq, tokens, pos), step.id)
            for pos in range(start + n):  # attention reads all its context
                slot = self.device[seq.block_ids[pos // bs]][pos % bs]
                assert self.holds(slot, self.key(seq, tokens, pos)), f"{rid} reads wrong K/V at {pos}"

    # --- rules --------------------------------------------------------------------------------

    @precondition(lambda self: len(self.inflight) <= 1 and len(self.seqs) < 16)
    @rule(requests=st.lists(REQUESTS, min_size=1, max_size=3))
    def add(self, requests: list[tuple[int, int, list[int], bytes, int, frozenset[int]]]) -> None:
        """Requests arriving between steps: prompts sharing a prefix (some of it, or some of it and
        more), of one of a few scopes, some ending at a stop token."""
        for prefix, shared, tail, scope, max_tokens, stop_ids in requests:
            prompt = (self.prefixes[prefix][:shared] + tail)[: self.capacity - 1] or [1]
            max_tokens = min(max_tokens, self.capacity - len(prompt))  # validation caps it so
            rid = f"r{len(self.seqs)}"
            # the smallest stop id is the request's own stop_token_id, any other one stands for EOS
            params = SamplingParams(max_tokens=max_tokens, stop_token_ids=tuple(sorted(stop_ids))[:1])
            seq = Sequence(Request(rid, list(prompt), params, scope), list(prompt), len(prompt), 0,
                           self.capacity, stop_ids=stop_ids)
            self.seqs[rid], self.handed[rid], self.pending[rid] = seq, [], deque()
            self.s.add(seq)

    @precondition(lambda self: len(self.inflight) <= 1)
    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        """Schedule (and launch) the next step; with one in flight, this is step N+1."""
        self.launch(lambda: data.draw(TOKENS, label="token"))

    def launch(self, sample: Callable[[], int]) -> None:
        out = self.s.schedule()
        self.steps += 1
        step = Step(out, self.steps)
        self.run_on_device(step)
        for i, chunk in enumerate(out.chunks):
            if chunk.samples:
                step.tokens[i] = sample()
                self.pending[chunk.seq.request_id].append(step.tokens[i])
        if out.chunks:  # the engine launches nothing for an empty step (its copies are queued)
            self.inflight.append(step)

    @rule(n=st.integers(1, 12))
    def pressure(self, n: int) -> None:
        """Another request's room taken and given back, as one admitted and cancelled at once would:
        the least recently released cached blocks are evicted once the free ones are gone."""
        other = Sequence(Request("pressure", []), [], 0, 0, self.capacity)
        self.blocks.grow(other, min(n, self.blocks.num_free))
        self.blocks.free(other)

    def left_on_device(self) -> set[int]:
        """The blocks offloaded sequences left cached on the device (not copied out)."""
        by_digest = self.blocks._by_digest
        return {
            by_digest[d]
            for q in self.seqs.values()
            for d in q.block_digests[: q.host_blocks.count(ON_DEVICE)]
            if d in by_digest
        }

    @precondition(lambda self: len(self.inflight) <= 1 and self.left_on_device())
    @rule(data=st.data())
    def evict_what_an_offloaded_one_left(self, data: st.DataObject) -> None:
        """The sequences holding blocks an offloaded one left on the device are cancelled and their
        room taken: it cannot come back to them (rare at random: it waits at most a step or two)."""
        left = self.left_on_device()
        for q in [q for q in self.seqs.values() if not q.finished and left & set(q.block_ids)]:
            assert self.s.abort(q.request_id) is q
            self.pending[q.request_id].clear()
        self.pressure(data.draw(st.integers(1, self.blocks.num_blocks), label="evicted"))

    @precondition(lambda self: self.inflight)
    @rule()
    def finish_oldest(self) -> None:
        self.finish(self.inflight.popleft())

    @precondition(lambda self: len(self.inflight) <= 1)
    @rule(turns=st.integers(1, 8), data=st.data())
    def run_turns(self, turns: int, data: st.DataObject) -> None:
        """Turns of the engine's asynchronous loop: schedule step N+1, then finish step N."""
        for _ in range(turns):
            self.launch(lambda: data.draw(TOKENS, label="token"))
            if self.inflight:
                self.finish(self.inflight.popleft())

    def finish(self, step: Step) -> None:
        """Hand a step's tokens over, and check that each went where it should, once."""
        expect_took = []
        for i, token in step.tokens.items():
            seq = step.out.chunks[i].seq
            rid = seq.request_id
            if not seq.finished:
                assert self.pending[rid] and self.pending[rid][0] == token, rid
                self.pending[rid].popleft()
                expect_took.append(i)
        took = self.s.finish_step(step.out, step.tokens)
        assert took == expect_took
        for i in took:
            seq = step.out.chunks[i].seq
            rid, token = seq.request_id, step.tokens[i]
            self.handed[rid].append(token)
            if token in seq.stop_ids:  # a stop reason only for the request's own stop_token_ids, not EOS
                stop_reason = token if token in seq.params.stop_token_ids else None
                assert seq.finish_reason is FinishReason.STOP and seq.stop_token == stop_reason
            elif len(self.handed[rid]) >= seq.params.max_tokens or len(seq.token_ids) >= self.capacity:
                assert seq.finish_reason is FinishReason.LENGTH
            else:
                assert not seq.finished
            if seq.finished:
                self.pending[rid].clear()  # anything still in flight for it is dropped

    @precondition(lambda self: len(self.inflight) <= 1 and any(not q.finished for q in self.seqs.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Abort a request, chosen by where it is: the rarer places would seldom be hit at random."""
        s = self.s
        live = [q for q in self.seqs.values() if not q.finished]
        places = {
            "offloaded": [q for q in live if q.host_blocks],
            "preempted": [q for q in s.waiting if q.num_preemptions],
            "suspect": list(s.suspects),
            "token in flight": [q for q in live if q.num_inflight],
            "running": list(s.running),
            "waiting": list(s.waiting),
        }
        place = data.draw(st.sampled_from([p for p, qs in places.items() if qs] or ["any"]), label="place")
        rid = data.draw(st.sampled_from(places.get(place, live)), label="abort").request_id
        assert self.s.abort(rid) is self.seqs[rid]
        assert self.seqs[rid].finish_reason is FinishReason.CANCELLED
        self.pending[rid].clear()
        assert self.s.abort(rid) is None  # gone: a second abort finds nothing

    @precondition(lambda self: self.inflight)
    @rule(launch_failed=st.booleans())
    def fail(self, launch_failed: bool) -> None:
        """A step failed, as EngineCore._contain handles it: the launch of step N+1 failed (step N
        finishes first), or the wait for step N did (step N+1 was built on it: both fail)."""
        if launch_failed and len(self.inflight) == 2:
            self.finish(self.inflight.popleft())
        failed = list(self.inflight)
        self.inflight.clear()
        self.failed_steps.update(step.id for step in failed)
        chunks = [c for step in failed for c in step.out.chunks]
        seqs = list({id(c.seq): c.seq for c in chunks if not c.seq.finished}.values())
        for seq in seqs:
            seq.num_failed_steps += 1
            self.pending[seq.request_id].clear()  # the tokens it had in flight are lost
        culprits = [q for q in seqs if len(seqs) == 1 or q.num_failed_steps >= MAX_FAILED_STEPS]
        for seq in culprits:
            assert self.s.abort(seq.request_id) is seq
        self.s.quarantine([q for q in seqs if q not in culprits])
        assert not any(self.pending.values()), "a token is in flight with no step in flight"

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def device_blocks_are_counted_and_never_shared_wrongly(self) -> None:
        blocks, n = self.blocks, self.blocks.num_blocks
        live = [q for q in self.seqs.values() if not q.finished]
        assert all(not q.block_ids and not q.host_blocks for q in self.seqs.values() if q.finished)
        holders = Counter(b for q in live for b in q.block_ids)
        assert all(blocks.refs(b) == holders.get(b, 0) for b in range(n)), "a reference count is off"
        for q in live:
            assert len(set(q.block_ids)) == len(q.block_ids), f"{q.request_id} holds a block twice"
        free, evictable = list(blocks._free), list(blocks._evictable)
        assert len(set(free)) == len(free) and not set(free) & set(evictable)
        assert not set(holders) & (set(free) | set(evictable)), "a block in use can be handed out"
        assert len(free) + len(evictable) + len(holders) == n
        assert set(evictable) <= set(blocks._digest) and not set(free) & set(blocks._digest)
        assert {d: b for b, d in blocks._digest.items()} == blocks._by_digest
        assert 0 <= blocks.hit_tokens <= blocks.queried_tokens

    @invariant()
    def cached_blocks_hold_what_their_digest_names(self) -> None:
        for digest, block in self.blocks._by_digest.items():
            last = self.device[block][-1]
            assert last is not None and last[1] not in self.failed_steps, "a cached block holds garbage"
            scope, tokens = last[0]
            for i, slot in enumerate(self.device[block]):  # one chain: the last slot's prefixes
                assert self.holds(slot, (scope, tokens[: len(tokens) - self.bs + 1 + i]))
            assert self.digest_content.setdefault(digest, last[0]) == last[0], "a digest names two contents"

    @invariant()
    def every_sequence_is_in_one_place_with_its_kv(self) -> None:
        s, bs = self.s, self.bs
        places = Counter(id(q) for queue in (s.running, s.waiting, s.suspects) for q in queue)
        for rid, q in self.seqs.items():
            assert places[id(q)] == (0 if q.finished else 1), f"{rid} is in {places[id(q)]} queues"
            assert q.token_ids == q.token_ids[: q.prompt_len] + self.handed[rid], rid
            if q.finished:  # a token still in flight for it is dropped when it comes
                continue
            assert q.num_inflight == len(self.pending[rid]), rid
            assert q.cached_tokens is None or q.cached_tokens < q.prompt_len, rid  # its usage's hits
            tokens = self.virtual_tokens(q)
            if q.host_blocks:  # offloaded: its K/V wait in the pool
                assert q in s.waiting and not q.block_ids, rid
                assert len(q.host_blocks) == -(-q.num_computed // bs), rid
                kept = q.host_blocks.count(ON_DEVICE)  # leading blocks left cached on the device
                assert q.host_blocks[:kept] == [ON_DEVICE] * kept, rid
                for pos in range(kept * bs, q.num_computed):
                    slot = self.pool[q.host_blocks[pos // bs]][pos % bs]
                    assert self.holds(slot, self.key(q, tokens, pos)), f"{rid}'s offloaded K/V are wrong"
            elif q in s.waiting:
                assert not q.block_ids and q.num_computed == 0, rid
            else:
                assert len(q.block_ids) * bs >= q.num_computed, rid
                for pos in range(q.num_computed):
                    slot = self.device[q.block_ids[pos // bs]][pos % bs]
                    assert self.holds(slot, self.key(q, tokens, pos)), f"{rid}'s K/V are wrong at {pos}"

    @invariant()
    def host_blocks_have_one_owner(self) -> None:
        held = [h for q in self.seqs.values() for h in q.host_blocks if h != ON_DEVICE]
        assert len(held) == len(set(held)), "a host block is held twice"
        assert len(held) + self.host.num_free == self.host.num_blocks
        assert len(set(self.host._free)) == len(self.host._free) and not set(held) & set(self.host._free)

    def teardown(self) -> None:
        """Drain as the engine does (schedule ahead, then finish the oldest step): every request
        finishes, and every block is free (or cached and unused) and the pool empty."""
        if not hasattr(self, "s"):
            return
        tokens = iter(range(10**6))
        for _ in range(5000):
            if not (self.s.has_work or self.inflight):
                break
            if self.s.has_work and len(self.inflight) <= 1:
                self.launch(lambda: next(tokens) % VOCAB)
            if self.inflight:
                self.finish(self.inflight.popleft())
            self.every_sequence_is_in_one_place_with_its_kv()
        assert not self.s.has_work and not self.inflight, "draining did not finish every request"
        assert all(q.finished for q in self.seqs.values())
        self.device_blocks_are_counted_and_never_shared_wrongly()
        self.host_blocks_have_one_owner()
        assert self.blocks.num_free == self.blocks.num_blocks and self.host.num_free == self.host.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase
