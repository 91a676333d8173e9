"""KV offload on preemption: the host pool's bookkeeping, the scheduler's use of it, the copies
between the device cache and the pool, and greedy parity with transformers' generate()."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from engine_harness import Arrival, block_holders, hf_greedy, make_core, run
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from tandem.service.contract import Request, SamplingParams
from tandem.service.engine.block_manager import BlockManager
from tandem.service.engine.config import EngineConfig
from tandem.service.engine.core_builder import build_core
from tandem.service.engine.host_blocks import ON_DEVICE, HostBlocks
from tandem.service.engine.kv_offload import KVOffload, _runs
from tandem.service.engine.ops.kv_cache import CacheShape, KVCache
from tandem.service.engine.scheduler import BlockMoves, Scheduler, SchedulerOutput
from tandem.service.engine.sequence import Sequence


def seq(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    request = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))
    return Sequence(request, list(tokens), len(tokens), 0, 10_000)


def finish(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """Hand a step's tokens back: `token` to each chunk that samples."""
    s.finish_step(out, {i: token for i, c in enumerate(out.chunks) if c.samples})


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    finish(s, out, token)
    return out


# --- the pool's bookkeeping ---------------------------------------------------------------------


def test_the_host_pool_hands_out_its_lowest_free_blocks_first():
    pool = HostBlocks(8)
    assert pool.allocate(3) == [0, 1, 2] and pool.allocate(2) == [3, 4]
    pool.free([1, 0])
    assert pool.allocate(3) == [0, 1, 5] and pool.num_free == 2 and pool.usage == 0.75
    assert not pool.can_allocate(3)
    with pytest.raises(RuntimeError):
        pool.allocate(3)


def test_a_pool_not_yet_allocated_hands_out_nothing_until_it_opens():
    pool = HostBlocks(4, is_open=False)
    assert not pool.is_open and pool.num_free == 0 and not pool.can_allocate(1) and pool.usage == 0.0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.open()
    assert pool.is_open and pool.num_free == 4 and pool.allocate(2) == [0, 1] and pool.usage == 0.5
    pool.open()  # once: what is handed out stays handed out
    assert pool.num_free == 2


def test_copies_go_in_runs_of_consecutive_pool_blocks():
    assert _runs([4, 5, 6, 9, 10, 2]) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert _runs([]) == []


# --- the scheduler ------------------------------------------------------------------------------


def _two_running(num_blocks: int, host: HostBlocks | None) -> tuple[Scheduler, Sequence, Sequence]:
    """a (admitted first) and b decoding in a cache with no block to spare for their next block."""
    s = Scheduler(BlockManager(num_blocks, 4), max_num_seqs=4, max_num_batched_tokens=64, host=host)
    a, b = seq("a", list(range(8)), max_tokens=10), seq("b", list(range(20, 28)), max_tokens=10)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 8 tokens + the next in a third block each
    return s, a, b


def test_a_preempted_sequence_keeps_its_kv_in_the_host_pool_and_gets_it_back():
    s, a, b = _two_running(6, HostBlocks(8))
    for _ in range(4):
        step(s)  # both at 12 tokens computed: their third blocks full
    b_blocks = list(b.block_ids)
    out = s.schedule()  # a needs a fourth block: b (the newest) goes to the pool
    assert out.preempted == [b] and b in s.waiting
    assert out.moves.out_device == b_blocks and out.moves.out_host == [0, 1, 2] == b.host_blocks
    assert b.num_computed == 12 and list(b.block_ids) == [] and s.host.num_free == 5
    assert (s.preempted_offload, s.preempted_recompute, s.blocks_offloaded) == (1, 0, 3)
    s.finish_step(out, {0: 7})
    while b in s.waiting:  # a finishes; b comes back with its K/V, computing only its next token
        out = step(s)
    chunk = next(c for c in out.chunks if c.seq is b)
    assert (chunk.start, chunk.num_tokens) == (12, 1)
    assert out.moves.in_host == [0, 1, 2] and out.moves.in_device == list(b.block_ids[:3])
    assert b.host_blocks == [] and s.host.num_free == 8 and s.blocks_restored == 3


def test_an_offloaded_sequence_comes_back_to_its_blocks_still_cached_without_copying_them():
    """With prefix caching, blocks a preempted sequence leaves stay cached until their room is
    needed: if nobody took them, it comes back to them, and nothing is copied in."""
    s = Scheduler(BlockManager(7, 4, prefix_caching=True), max_num_seqs=4, max_num_batched_tokens=64,
                  host=HostBlocks(8))  # fmt: skip
    a, b = seq("a", list(range(8)), max_tokens=6), seq("b", list(range(20, 28)), max_tokens=10)
    s.add(a)
    s.add(b)
    for _ in range(5):
        step(s)  # both at 12 tokens: three blocks each, the last of the 7 free
    b_blocks = list(b.block_ids)
    out = step(s)  # a needs its fourth block: b goes to the pool; a finishes
    assert out.preempted == [b] and out.moves.out_device == b_blocks and a.finish_reason is not None
    out = step(s)
    assert [c.seq for c in out.chunks] == [b] and not out.moves  # b's K/V never left: no copy in
    assert list(b.block_ids[:3]) == b_blocks and b.host_blocks == [] and s.host.num_free == 8
    assert (s.blocks_offloaded, s.blocks_restored, s.blocks_reused) == (3, 0, 3)


def test_an_offloaded_sequence_leaves_the_prefix_it_shares_on_the_device_and_copies_the_rest():
    """Its first block is shared with a running sequence (still referenced): it is neither copied out
    nor in, and is shared again when it comes back; its second was evicted while it waited, so the
    rest is copied in."""
    s = Scheduler(BlockManager(8, 4, prefix_caching=True), max_num_seqs=4, max_num_batched_tokens=64,
                  host=HostBlocks(8))  # fmt: skip
    b = seq("b", list(range(20, 28)), max_tokens=10)
    c = seq("c", list(range(20, 24)) + list(range(40, 44)), max_tokens=16)
    a = seq("a", list(range(20, 24)) + list(range(4)), max_tokens=6)
    s.add(b)
    step(s)
    s.add(c)
    s.add(a)
    while not a.host_blocks:
        before = list(a.block_ids)
        out = step(s)
    assert before[0] == c.block_ids[0] and a.host_blocks == [ON_DEVICE, 0, 1]
    assert out.moves.out_device == before[1:3] and out.moves.out_host == [0, 1]
    while a in s.waiting:
        out = s.schedule()
        a_blocks, refs = list(a.block_ids), [s.blocks.refs(b) for b in a.block_ids]  # a may finish in it
        finish(s, out)
    assert a.host_blocks == [] and a in (ch.seq for ch in out.chunks)
    assert a_blocks[0] == c.block_ids[0] and refs[:3] == [2, 1, 1]  # c's first block, shared
    assert out.moves.in_host == [0, 1] and out.moves.in_device == a_blocks[1:3]
    assert (s.blocks_offloaded, s.blocks_restored, s.blocks_reused, s.blocks_kept) == (2, 2, 0, 1)
    while s.has_work:
        step(s)
    assert s.blocks.num_free == 8 and s.host.num_free == 8


def test_an_offloaded_sequence_whose_uncopied_prefix_was_evicted_is_recomputed_from_there():
    """The block it left on the device is shared with c; c is cancelled and every block's room is
    then needed (taken here straight from the block manager), so that block is evicted while a
    waits: a cannot come back to it, so it is recomputed from its tokens, and its pool blocks go."""
    s = Scheduler(BlockManager(8, 4, prefix_caching=True), max_num_seqs=2, max_num_batched_tokens=64,
                  host=HostBlocks(8))  # fmt: skip
    c = seq("c", list(range(20, 24)) + list(range(40, 44)), max_tokens=12)
    a = seq("a", list(range(20, 24)) + list(range(4)), max_tokens=12)
    s.add(c)
    step(s)
    s.add(a)
    while not a.host_blocks:
        out = step(s)
    assert a.host_blocks == [ON_DEVICE, 0, 1, 2] and out.moves.out_host == [0, 1, 2]
    s.abort("c")
    everything = seq("x", [])
    s.blocks.grow(everything, s.blocks.num_blocks)  # evicts every cached block
    s.blocks.free(everything)
    out = step(s)
    assert [(ch.seq, ch.start, ch.num_tokens) for ch in out.chunks] == [(a, 0, 17)] and not out.moves
    assert a.host_blocks == [] and s.host.num_free == 8
    assert (s.blocks_offloaded, s.blocks_restored, s.blocks_reused, s.blocks_kept) == (3, 0, 0, 1)
    while s.has_work:
        step(s)
    assert s.blocks.num_free == 8 and a.finish_reason == "length"


def test_a_sequence_whose_token_in_flight_ends_it_is_preempted_without_copying_its_kv():
    """The asynchronous loop schedules step N+1 before step N's tokens are back: b's token in step N
    is its last, so b is not in step N+1, and a, which needs a block there, preempts it. b never
    runs again: its blocks are freed, nothing goes to the pool, and it finishes with that token."""
    s = Scheduler(BlockManager(6, 4), max_num_seqs=4, max_num_batched_tokens=64, host=HostBlocks(8))
    a, b = seq("a", list(range(8)), max_tokens=10), seq("b", list(range(20, 28)), max_tokens=5)
    s.add(a)
    s.add(b)
    prev = s.schedule()
    while not b.will_finish_by_length:
        out = s.schedule()
        finish(s, prev)
        prev = out
    out = s.schedule()  # a's position 12 needs a fourth block
    assert out.preempted == [b] and not out.moves and s.host.num_free == 8
    assert (s.preempted_offload, s.preempted_recompute) == (0, 0)
    finish(s, prev)
    assert b.finish_reason == "length" and len(b.token_ids) == 8 + 5 and b not in s.waiting
    s.finish_step(out, {0: 7})
    while s.has_work:
        step(s)
    assert s.blocks.num_free == 6 and s.host.num_free == 8


def test_without_room_in_the_pool_a_preempted_sequence_is_recomputed():
    s, a, b = _two_running(6, HostBlocks(2))  # b's three blocks do not fit
    for _ in range(4):
        step(s)
    out = s.schedule()
    assert out.preempted == [b] and not out.moves and b.num_computed == 0 and b.host_blocks == []
    assert (s.preempted_offload, s.preempted_recompute) == (0, 1)


def test_aborting_an_offloaded_sequence_frees_its_pool_blocks():
    s, a, b = _two_running(6, HostBlocks(8))
    for _ in range(4):
        step(s)
    s.finish_step(s.schedule(), {0: 7})
    assert b.host_blocks
    s.abort("b")
    assert s.host.num_free == 8 and b.host_blocks == []


@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8), st.booleans()), min_size=1, max_size=20),
    st.integers(12, 30),  # a request needs at most 30 + 8 tokens: 10 blocks (more is refused)
    st.integers(1, 24),
    st.booleans(),
    st.integers(0, 2**16),
)
@settings(max_examples=150, deadline=None)
def test_device_and_pool_blocks_never_leak_and_are_never_shared(
    requests, num_blocks, host_blocks, prefix_caching, seed
):
    """Random requests, some aborted, in a cache small enough to preempt and a pool small enough
    to fill: each pool block is held by at most one sequence, and only by a waiting one; device
    reference counts match the sequences holding them; at the end everything is free."""
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks, 4, prefix_caching=prefix_caching)
    pool = HostBlocks(host_blocks)
    s = Scheduler(blocks, max_num_seqs=6, max_num_batched_tokens=24, host=pool)
    pending = [
        (seq(f"r{i}", [rng.randrange(50) for _ in range(n)], max_tokens=new), abort)
        for i, (n, new, abort) in enumerate(requests)
    ]
    live: list[Sequence] = []
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            new_seq, abort = pending.pop(0)
            s.add(new_seq)
            live.append(new_seq)
            if abort and rng.random() < 0.3:
                s.abort(new_seq.request_id)
        if not s.has_work and not pending:
            break
        out = s.schedule()
        # the copies out read blocks the preempted held; the copies in fill blocks the restored got
        assert len(out.moves.out_device) == len(out.moves.out_host)
        assert len(out.moves.in_host) == len(out.moves.in_device)
        s.finish_step(out, {i: rng.randrange(50) for i, c in enumerate(out.chunks) if c.samples})
        held = [b for q in live for b in q.host_blocks if b != ON_DEVICE]
        assert len(held) == len(set(held)) and len(held) + pool.num_free == host_blocks
        assert all(q in s.waiting for q in live if q.host_blocks)
        holders = block_holders(live)
        assert all(blocks.refs(b) == holders[b] for b in range(num_blocks))
    assert not s.has_work
    assert blocks.num_free == num_blocks and pool.num_free == host_blocks


# --- the copies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_blocks_copied_out_and_back_in_hold_the_same_kv(layout):
    shape = CacheShape(num_layers=2, num_kv_heads=3, head_dim=8)
    cache = KVCache(
        shape, num_blocks=6, block_size=4, dtype=torch.float32, device=torch.device("cpu"), layout=layout
    )
    cache.k_store.copy_(torch.randn_like(cache.k_store))
    cache.v_store.copy_(torch.randn_like(cache.v_store))
    k0, v0 = cache.k.clone(), cache.v.clone()
    offload = KVOffload(cache, num_blocks=5)
    offload.allocate()
    offload.queue(BlockMoves(out_device=[1, 4, 2], out_host=[3, 4, 0]))
    cache.k_store.zero_()
    cache.v_store.zero_()
    offload.queue(BlockMoves(in_host=[3, 4, 0], in_device=[5, 0, 3]))  # back into other blocks
    bs = cache.block_size

    def block(t: torch.Tensor, b: int) -> torch.Tensor:
        return t[:, b * bs : (b + 1) * bs]

    for src, dst in [(1, 5), (4, 0), (2, 3)]:
        assert torch.equal(block(cache.k, dst), block(k0, src)) and torch.equal(
            block(cache.v, dst), block(v0, src)
        )
    assert not block(cache.k, 1).any() and not block(cache.k, 2).any()  # nothing else was written


def test_a_pool_that_cannot_be_allocated_leaves_offload_off_with_a_warning(monkeypatch, caplog):
    shape = CacheShape(num_layers=2, num_kv_heads=3, head_dim=8)
    cache = KVCache(shape, num_blocks=6, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    offload = KVOffload(cache, num_blocks=5)
    assert not offload.ready and offload.nbytes == 5 * 2 * 2 * 4 * 3 * 8 * 4

    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch, "empty", refuse)
    offload.allocate(background=True)
    assert not offload.wait(timeout=10) and offload.store is None
    assert "KV offload is off" in caplog.text and "out of memory" in caplog.text


# --- greedy parity with generate() --------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()


def _arrivals(vocab: int, seed: int, shared: int = 0) -> list[Arrival]:
    """Seven requests arriving over six steps, their prompts starting with `shared` common tokens."""
    rng = random.Random(seed)
    common = [rng.randrange(vocab) for _ in range(shared)]
    lengths, steps = [30, 22, 41, 9, 17, 26, 35], [0, 0, 1, 1, 2, 4, 6]
    return [
        Arrival(f"r{i}", common + [rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=24), at)
        for i, (n, at) in enumerate(zip(lengths, steps, strict=True))
    ]


@pytest.mark.parametrize("loop", ["sync", "async"])
@pytest.mark.parametrize(
    "pool, prefix_caching, shared",
    # room for all; room for some (both paths); with the prefix cache; and a prefix all share
    [(64, False, 0), (6, False, 0), (64, True, 0), (64, True, 12)],
)
def test_offloaded_sequences_get_generate_tokens(llama, loop, pool, prefix_caching, shared):
    arrivals = _arrivals(llama.config.vocab_size, seed=3, shared=shared)
    # 24 blocks x 4 = 96 cache slots for seven requests of up to 77 tokens each: preemption is forced
    core = make_core(
        llama, num_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=96, step_loop=loop,
        kv_offload_blocks=pool, prefix_caching=prefix_caching,
    )  # fmt: skip
    result = run(core, arrivals)
    s = core.scheduler
    # every request runs to max_tokens and is preempted only with more to compute: all come back
    assert s.preempted_offload > 0 and s.blocks_restored + s.blocks_reused == s.blocks_offloaded
    if shared:  # some leave the shared prefix on the device, held by those still running
        assert s.blocks_kept > 0
    else:
        assert s.blocks_kept == 0
        if prefix_caching:  # some come back to their own blocks, still cached on the device
            assert s.blocks_reused > 0
    if pool == 6:
        assert s.preempted_recompute > 0, "the pool was meant to be too small for some preemptions"
    else:
        assert s.preempted_recompute == 0
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(llama, a.prompt_ids, 24, None), a.request_id
    stats = core.stats()
    assert (stats.preemptions_offload, stats.kv_offload_blocks_in) == (s.preempted_offload, s.blocks_restored)
    assert (stats.kv_offload_blocks_reused, stats.kv_offload_blocks_kept) == (s.blocks_reused, s.blocks_kept)


def test_a_pool_allocated_in_the_background_opens_once_it_is_there(llama, monkeypatch):
    """The server's core pins its host pool on a thread: until the pool exists, preempted sequences
    are recomputed; once it does, the next step opens it and preemptions copy their K/V out; every
    request still gets generate()'s tokens."""
    allow = threading.Event()
    allocate = KVOffload._allocate

    def held_back(self: KVOffload) -> None:
        assert allow.wait(60)
        allocate(self)

    monkeypatch.setattr(KVOffload, "_allocate", held_back)
    config = EngineConfig(num_blocks=24, block_size=4, max_num_seqs=16, max_num_batched_tokens=32,
                          max_model_len=96, kv_offload_blocks=64)  # as make_core's, the pool aside
    core = build_core(llama, config, host_pool_in_background=True)
    s = core.scheduler
    assert s.host is not None and not s.host.is_open and core.stats().kv_offload_usage == 0.0
    first = _arrivals(llama.config.vocab_size, seed=3)
    result = run(core, first)
    assert s.preempted_recompute > 0 and s.preempted_offload == 0 and not s.host.is_open
    allow.set()
    assert core.runner.offload is not None and core.runner.offload.wait(timeout=60)
    vocab = llama.config.vocab_size
    later = [Arrival(f"later-{a.request_id}", a.prompt_ids, a.params, 0) for a in _arrivals(vocab, seed=4)]
    result.tokens.update(run(core, later).tokens)
    assert s.host.is_open and s.preempted_offload > 0
    assert s.blocks_restored + s.blocks_reused == s.blocks_offloaded
    for a in first + later:
        assert result.tokens[a.request_id] == hf_greedy(llama, a.prompt_ids, 24, None), a.request_id


def test_waiting_for_a_pool_allocated_in_the_background_opens_it(llama, monkeypatch):
    """What the engine process does before it serves: no step of a request waits behind the pinning."""
    allocate = KVOffload._allocate

    def slow(self: KVOffload) -> None:
        time.sleep(0.3)
        allocate(self)

    monkeypatch.setattr(KVOffload, "_allocate", slow)
    config = EngineConfig(num_blocks=24, block_size=4, max_num_seqs=16, max_num_batched_tokens=32,
                          max_model_len=96, kv_offload_blocks=64)
    core = build_core(llama, config, host_pool_in_background=True)
    assert core.scheduler.host is not None and not core.scheduler.host.is_open
    assert core.wait_for_host_pool() >= 0.2
    assert core.scheduler.host.is_open and core.scheduler.host.num_free == 64
    assert core.wait_for_host_pool() < 0.1  # once there, nothing to wait for


def test_a_core_whose_pool_cannot_be_allocated_recomputes_its_preemptions(llama, monkeypatch, caplog):
    """A pool too large for the host (here 1 PiB) is not an engine failure: the core builds, offload
    stays off with a warning, every preemption recomputes, and every request gets generate()'s tokens."""
    allocate = KVOffload._allocate

    def too_large(self: KVOffload) -> None:
        self.shape = (1 << 50,)
        allocate(self)

    monkeypatch.setattr(KVOffload, "_allocate", too_large)
    core = make_core(llama, num_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=96,
                     kv_offload_blocks=64)
    assert "KV offload is off" in caplog.text
    arrivals = _arrivals(llama.config.vocab_size, seed=3)
    result = run(core, arrivals)
    s = core.scheduler
    assert s.host is not None and not s.host.is_open
    assert s.preempted_recompute > 0 and s.preempted_offload == 0
    for a in arrivals:
        assert result.tokens[a.request_id] == hf_greedy(llama, a.prompt_ids, 24, None), a.request_id
