"""Automatic prefix caching: the block manager's cache (digest chains, reference counts, LRU
eviction), the scheduler's use of it, and greedy parity with transformers' generate()."""

from __future__ import annotations

import random

import pytest
import torch
from engine_harness import Arrival, block_holders, hf_greedy, make_core, run
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.block_manager import BlockManager
from tandem.service.engine.scheduler import Scheduler, SchedulerOutput
from tandem.service.engine.sequence import Sequence


def seq(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    request = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))
    return Sequence(request, list(tokens), len(tokens), 0, 10_000)


def computed(blocks: BlockManager, s: Sequence) -> None:
    """Give `s` blocks for all its tokens and mark their K/V written (what a step does)."""
    blocks.allocate(s, s.num_uncomputed)
    s.num_computed = s.length
    blocks.cache_computed(s, s.num_computed)


# --- the block manager --------------------------------------------------------------------------


def test_a_prefix_of_full_blocks_is_shared_and_one_token_is_left_to_compute():
    blocks = BlockManager(16, 4, prefix_caching=True)
    a = seq("a", list(range(10)))  # blocks [0-3] [4-7] full, [8-9] partial
    computed(blocks, a)
    b = seq("b", list(range(8)) + [99, 98])
    assert blocks.match_prefix(b) == 8
    assert b.block_ids == a.block_ids[:2] and b.num_computed == 8
    assert [blocks.refs(x) for x in a.block_ids] == [2, 2, 1]
    # the same 8 tokens alone: the second block holds the last token, whose logits are needed
    c = seq("c", list(range(8)))
    assert blocks.match_prefix(c) == 4
    assert (blocks.queried_tokens, blocks.hit_tokens) == (18, 12)


def test_a_block_matches_only_behind_the_same_prefix():
    blocks = BlockManager(16, 4, prefix_caching=True)
    computed(blocks, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # the same second block behind a different first one is a different block
    assert blocks.match_prefix(seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0


def test_a_block_is_shared_only_within_its_cache_scope():
    """Requests of different cache scopes (tenants, salts) never share a block, whatever their
    tokens; requests of one scope do, and the shared scope (b"") keeps the digests it always had."""
    blocks = BlockManager(32, 4, prefix_caching=True)
    tokens = list(range(9))
    shared, tenant = seq("shared", tokens), seq("tenant", tokens)
    tenant.request.cache_scope = b"tenant-a"
    computed(blocks, shared)
    assert blocks.match_prefix(tenant) == 0  # the shared scope's blocks are not the tenant's
    blocks.free(tenant)
    computed(blocks, tenant)
    assert shared.block_digests[0] != tenant.block_digests[0]
    again = seq("again", tokens)
    again.request.cache_scope = b"tenant-a"
    assert blocks.match_prefix(again) == 8 and again.block_ids == tenant.block_ids[:2]
    other = seq("other", tokens)
    other.request.cache_scope = b"tenant-b"
    assert blocks.match_prefix(other) == 0
    plain = seq("plain", tokens)
    assert blocks.match_prefix(plain) == 8 and plain.block_ids == shared.block_ids[:2]
    # the shared scope's chain starts at the model's root, as before scopes existed
    assert blocks._scope_root(b"") == blocks._root


def test_a_request_reports_the_prompt_tokens_it_found_cached(llama):
    """Each request's first token carries the prompt tokens its first admission found cached: the
    prefix of a request of its own scope, nothing of another scope's."""
    rng = random.Random(4)
    system = [rng.randrange(llama.config.vocab_size) for _ in range(20)]  # 5 blocks of 4
    params = SamplingParams(max_tokens=2)
    arrivals = [
        Arrival("first", system + [1, 2], params, 0),
        Arrival("same-scope", system + [3], params, 4),
        Arrival("other-scope", system + [3], params, 4, cache_scope=b"other"),
        Arrival("other-again", system + [4, 5, 6], params, 8, cache_scope=b"other"),
    ]
    result = run(make_core(llama, num_blocks=64, block_size=4, prefix_caching=True), arrivals)
    assert result.cached == {"first": 0, "same-scope": 20, "other-scope": 0, "other-again": 20}
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(llama, a.prompt_ids, 2, None), a.request_id


def test_released_blocks_stay_cached_and_the_least_recently_released_go_first():
    blocks = BlockManager(4, 2, prefix_caching=True)
    a, b = seq("a", [1, 2, 3]), seq("b", [7, 8, 9])
    computed(blocks, a)  # blocks: a [1,2] full + [3]; b [7,8] full + [9]
    computed(blocks, b)
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free == 4 and blocks.num_cached == 2 and blocks.usage == 0.0
    c = seq("c", [5, 5, 5])
    blocks.allocate(c, 3)  # 2 blocks: the 2 holding nothing first, no cached block evicted
    assert blocks.num_cached == 2
    d = seq("d", [6, 6, 6])
    blocks.allocate(d, 1)  # now a cached one goes: a's, released first
    assert blocks.match_prefix(seq("a2", [1, 2, 3])) == 0
    assert blocks.match_prefix(seq("b2", [7, 8, 9])) == 2


def test_a_referenced_block_is_never_evicted():
    blocks = BlockManager(3, 2, prefix_caching=True)
    a = seq("a", [1, 2, 3])
    computed(blocks, a)
    b = seq("b", [1, 2, 4])
    assert blocks.match_prefix(b) == 2
    blocks.free(a)  # b still holds the shared block
    other = seq("x", [9, 9, 9])
    with pytest.raises(RuntimeError):
        blocks.allocate(other, 5)  # 3 blocks wanted: only the 2 nobody references can be had
    blocks.allocate(other, 4)
    assert blocks.refs(b.block_ids[0]) == 1 and b.block_ids[0] not in other.block_ids


def test_without_prefix_caching_nothing_is_cached():
    blocks = BlockManager(8, 2)
    computed(blocks, seq("a", [1, 2, 3]))
    assert blocks.match_prefix(seq("b", [1, 2, 3])) == 0 and blocks.num_cached == 0


def test_digests_are_sha256_of_the_chain_not_python_hash():
    """A forged prefix must not read another user's K/V: the chain's digests are SHA-256 over
    the model's salt and every token before."""
    one = BlockManager(8, 2, prefix_caching=True, salt="model-a")
    two = BlockManager(8, 2, prefix_caching=True, salt="model-b")
    s1, s2 = seq("a", [1, 2, 3]), seq("b", [1, 2, 3])
    computed(one, s1)
    computed(two, s2)
    assert len(s1.block_digests[0]) == 32 and s1.block_digests != s2.block_digests


# --- the scheduler ------------------------------------------------------------------------------


def fake_step(s: Scheduler, token: int = 7) -> list[int]:
    out = s.schedule()
    return s.finish_step(out, {i: token for i, c in enumerate(out.chunks) if c.samples})


def test_a_later_request_skips_the_cached_prefix_and_counts_the_hit():
    s = Scheduler(BlockManager(64, 4, prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=64)
    system = list(range(100, 132))  # 32 tokens: 8 full blocks
    s.add(seq("a", system + [1, 2, 3]))
    fake_step(s)
    s.add(seq("b", system + [4, 5]))
    out = s.schedule()
    b = next(c for c in out.chunks if c.seq.request_id == "b")
    assert (b.start, b.num_tokens) == (32, 2)  # only its own tokens are prefilled
    assert s.blocks.hit_tokens == 32 and s.blocks.queried_tokens == 35 + 34


def test_a_request_waiting_for_room_is_counted_once_hit_or_not():
    """The head of the queue is looked up each step it waits for room; the counters count its
    prompt once, when it is admitted (they once counted a waiting prompt with no hit every step)."""
    s = Scheduler(BlockManager(6, 4, prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(seq("a", list(range(12))))  # 3 blocks, and a fourth as it decodes
    s.add(seq("hit", list(range(8)) + list(range(90, 99))))  # a's first 2 blocks + 3 more: waits for a
    s.add(seq("miss", list(range(50, 59))))  # 3 blocks, no hit: waits for "hit" to finish
    while s.has_work:
        fake_step(s)
    assert (s.blocks.queried_tokens, s.blocks.hit_tokens) == (12 + 17 + 9, 8)


def test_the_rest_after_a_cached_prefix_is_chunked_at_the_budget_beside_decodes():
    """A prompt whose uncached rest is longer than the step budget: its first chunk starts where
    the cache ends, takes what the running decode leaves of the budget, and the next chunks carry
    on from there until the prompt is in."""
    s = Scheduler(BlockManager(64, 4, prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=8)
    system = list(range(100, 116))  # 16 tokens: 4 full blocks
    s.add(seq("a", system + [1], max_tokens=20))
    while s.blocks.num_cached < 4:  # a's prompt goes in, in chunks of the budget
        fake_step(s)
    s.add(seq("b", system + list(range(200, 211))))  # 11 tokens of its own past the cached 16
    spans = []
    while True:
        out = s.schedule()
        s.finish_step(out, {i: 7 for i, c in enumerate(out.chunks) if c.samples})
        mine = [c for c in out.chunks if c.seq.request_id == "b"]
        assert sum(c.num_tokens for c in out.chunks) <= 8
        if mine and mine[0].num_tokens > 1:
            spans.append((mine[0].start, mine[0].num_tokens))
        elif mine:
            break
    assert spans == [(16, 7), (23, 4)]  # a's decode takes one token of each step's budget
    assert s.blocks.hit_tokens >= 16


def test_blocks_of_a_step_are_not_shared_before_its_tokens_come_back():
    """Two requests with the same prompt in one step: the second cannot read blocks the first is
    writing in that very step, so both compute their own."""
    s = Scheduler(BlockManager(64, 4, prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(seq("a", list(range(12))))
    s.add(seq("b", list(range(12))))
    out = s.schedule()
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 12), (0, 12)]
    s.finish_step(out, {0: 7, 1: 7})
    assert s.blocks.num_cached == 3  # a's three full blocks; b's copies stay its own


def test_a_preempted_chunk_caches_nothing():
    """The asynchronous loop schedules step N+1 before step N's tokens come back; a sequence
    preempted in between has new blocks (or none), which step N did not write."""
    s = Scheduler(BlockManager(64, 4, prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=64)
    a = seq("a", list(range(12)))
    s.add(a)
    out = s.schedule()
    s._preempt(a, SchedulerOutput([], []))
    s.finish_step(out, {})
    assert s.blocks.num_cached == 0


def test_a_chunk_of_a_sequence_preempted_and_readmitted_meanwhile_caches_nothing():
    """Preempted between the scheduling of step N and its tokens' return, and readmitted into new
    blocks by step N+1: step N wrote the old blocks, so its chunk must not make the new ones
    findable (step N+1, still in flight, has not written them)."""
    s = Scheduler(BlockManager(64, 4, prefix_caching=True), max_num_seqs=8, max_num_batched_tokens=8)
    a = seq("a", list(range(12)))
    s.add(a)
    step_n = s.schedule()  # a's first 8 tokens: two full blocks
    s._preempt(a, SchedulerOutput([], []))
    step_n1 = s.schedule()  # a again from its start, in new blocks
    assert [(c.seq, c.start, c.num_tokens) for c in step_n1.chunks] == [(a, 0, 8)]
    s.finish_step(step_n, {})
    assert s.blocks.num_cached == 0 and a.blocks_cached == 0
    s.finish_step(step_n1, {})  # now they are written
    assert s.blocks.num_cached == 2 and a.blocks_cached == 2


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 6), st.booleans()),
        min_size=1,
        max_size=25,
    ),
    st.integers(13, 40),  # a request needs at most 16 + 30 + 6 tokens: 13 blocks (more is refused)
    st.integers(0, 2**16),
)
@settings(max_examples=150, deadline=None)
def test_reference_counts_and_the_free_list_never_leak(requests, num_blocks, seed):
    """Random requests sharing a few prefixes, some aborted, in a cache small enough to preempt
    and evict: every block is free, cached-and-unused, or referenced exactly as often as sequences
    hold it; a referenced block is never handed out; at the end every block is free again."""
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks, 4, prefix_caching=True)
    s = Scheduler(blocks, max_num_seqs=6, max_num_batched_tokens=24)
    prefixes = [[rng.randrange(50) for _ in range(16)] for _ in range(4)]
    pending = [
        (seq(f"r{i}", prefixes[p] + [rng.randrange(50) for _ in range(tail)], max_tokens=new), abort)
        for i, (p, tail, new, abort) in enumerate(requests)
    ]
    live: list[Sequence] = []
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            new_seq, abort = pending.pop(0)
            s.add(new_seq)
            live.append(new_seq)
            if abort and rng.random() < 0.5:
                s.abort(new_seq.request_id)
        if not s.has_work and not pending:
            break
        fake_step(s, token=rng.randrange(50))
        holders = block_holders(live)
        for b in range(num_blocks):
            assert blocks.refs(b) == holders.get(b, 0), b
        referenced = set(holders)
        assert not referenced & set(blocks._free) and not referenced & set(blocks._evictable)
        assert len(blocks._free) + len(blocks._evictable) + len(referenced) == num_blocks
    assert not s.has_work
    assert blocks.num_free == num_blocks
    assert 0 <= blocks.hit_tokens <= blocks.queried_tokens


# --- greedy parity with generate() --------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_shared_prefixes_arriving_later_and_preempted_match_generate(llama, loop):
    """Requests sharing a system prompt (and one that is another's whole prompt), arriving at
    different steps, in a cache small enough to preempt: each gets generate()'s greedy tokens,
    and the later ones were served from the cache."""
    rng = random.Random(5)
    vocab = llama.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(24)]
    prompts = [system + [rng.randrange(vocab) for _ in range(n)] for n in (3, 9, 1, 14, 6, 0)]
    arrivals = [
        Arrival(f"r{i}", p, SamplingParams(max_tokens=16), at)
        for i, (p, at) in enumerate(zip(prompts, [0, 3, 6, 6, 9, 12], strict=True))
    ]
    core = make_core(
        llama, num_blocks=30, block_size=4, max_num_batched_tokens=32, max_model_len=64,
        step_loop=loop, prefix_caching=True,
    )  # fmt: skip
    result = run(core, arrivals)
    blocks = core.scheduler.blocks
    assert blocks.hit_tokens >= 4 * 24 - 4, "later requests were meant to find the system prompt cached"
    assert result.preemptions > 0, "the cache was meant to be too small for all requests at once"
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(llama, a.prompt_ids, 16, None), a.request_id


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_chunks_continuing_a_cached_prefix_at_the_budget_edge_match_generate(llama, loop):
    """Prompts whose own tokens past a cached system prompt take several steps of a small budget
    (8 tokens, shared with the running decodes): each continues the cached prefix chunk by chunk
    and gets generate()'s greedy tokens."""
    rng = random.Random(13)
    vocab = llama.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(16)]
    prompts = [system + [rng.randrange(vocab) for _ in range(n)] for n in (2, 13, 21, 7, 17)]
    arrivals = [
        Arrival(f"r{i}", p, SamplingParams(max_tokens=10), at)
        for i, (p, at) in enumerate(zip(prompts, [0, 4, 5, 7, 9], strict=True))
    ]
    core = make_core(
        llama, num_blocks=48, block_size=4, max_num_batched_tokens=8, max_model_len=64,
        step_loop=loop, prefix_caching=True,
    )  # fmt: skip
    result = run(core, arrivals)
    assert core.scheduler.blocks.hit_tokens >= 4 * 16, "the later requests were meant to hit the cache"
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(llama, a.prompt_ids, 10, None), a.request_id


def test_the_hit_counters_equal_the_prefill_the_engine_skipped(llama):
    """Prompt tokens prefilled with the cache + tokens it reports as hits = prompt tokens
    prefilled without it, for the same requests."""
    rng = random.Random(9)
    system = [rng.randrange(llama.config.vocab_size) for _ in range(20)]
    arrivals = [
        Arrival(f"r{i}", system + [i + 1, i + 2], SamplingParams(max_tokens=3), 2 * i) for i in range(5)
    ]

    def prefilled(prefix_caching: bool) -> tuple[int, int]:
        core = make_core(llama, num_blocks=64, block_size=4, prefix_caching=prefix_caching)
        counted = []
        core.step_observer = lambda t: counted.append(t.num_tokens)  # every token a step computed
        run(core, arrivals)
        return sum(counted), core.scheduler.blocks.hit_tokens

    with_cache, hits = prefilled(True)
    without, no_hits = prefilled(False)
    assert no_hits == 0 and hits == 4 * 20
    assert with_cache + hits == without
