"""Scheduling policy on fake sequences: budget, chunking, decode first, FIFO, preemption, no deadlock."""

from __future__ import annotations

import random

from tandem.service.contract import FinishReason, Request, SamplingParams
from tandem.service.engine.block_manager import BlockManager
from tandem.service.engine.scheduler import Scheduler
from tandem.service.engine.sequence import Sequence


def seq(rid: str, prompt_len: int, max_tokens: int = 8) -> Sequence:
    prompt = list(range(prompt_len))
    return Sequence(Request(rid, prompt, SamplingParams(max_tokens=max_tokens)), list(prompt), prompt_len,
                    seed=0, max_total_len=10_000)


def fake_step(s: Scheduler) -> dict[str, int]:
    """Schedule and 'sample' token 7 for every sampling chunk; returns tokens per request this step."""
    out = s.schedule()
    sampled = {i: 7 for i, c in enumerate(out.chunks) if c.samples}
    s.finish_step(out, sampled)
    return {c.seq.request_id: c.num_tokens for c in out.chunks}


def test_token_budget_and_chunked_prefill():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=16)
    s.add(seq("a", 40))
    assert fake_step(s) == {"a": 16}
    assert fake_step(s) == {"a": 16}
    assert fake_step(s) == {"a": 8}  # last chunk samples the first new token
    assert s.running[0].num_output == 1


def test_decode_first_then_prefill_then_admission_in_fifo_order():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    s.add(seq("a", 3))
    s.add(seq("b", 3))
    fake_step(s)  # both prefilled (3 + 3 <= 10), both decoding now
    s.add(seq("c", 20))
    s.add(seq("d", 2))
    out = s.schedule()
    got = [(c.seq.request_id, c.num_tokens) for c in out.chunks]
    # decodes first (1 each), then c's chunk takes the rest; d must wait behind c (FIFO)
    assert got == [("a", 1), ("b", 1), ("c", 8)]
    assert [x.request_id for x in s.waiting] == ["d"]


def test_max_num_seqs_caps_the_batch():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for r in "abc":
        s.add(seq(r, 2))
    assert set(fake_step(s)) == {"a", "b"}
    assert [x.request_id for x in s.waiting] == ["c"]


def test_preemption_frees_the_newest_and_recomputes_later():
    # 4 blocks of 4 tokens; two sequences of 6 tokens take 2 blocks each; a decode past 8 needs a third
    s = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(seq("old", 6, max_tokens=10))
    s.add(seq("new", 6, max_tokens=10))
    fake_step(s)
    fake_step(s)
    fake_step(s)  # both at 8 computed tokens + 1 pending: the next decode needs block 3 for each
    out = s.schedule()
    assert [p.request_id for p in out.preempted] == ["new"]
    assert [c.seq.request_id for c in out.chunks] == ["old"]
    assert s.waiting[0].request_id == "new" and s.waiting[0].num_computed == 0


def test_random_workloads_never_deadlock_or_leak():
    rng = random.Random(0)
    for trial in range(30):
        blocks = BlockManager(rng.randint(8, 40), rng.choice([2, 4, 8]))
        cap = blocks.num_blocks * blocks.block_size
        s = Scheduler(blocks, rng.randint(1, 8), rng.randint(1, 64))
        seqs = []
        for i in range(rng.randint(1, 12)):
            prompt = rng.randint(1, cap // 2)
            x = seq(f"r{i}", prompt, max_tokens=rng.randint(1, cap - prompt))
            x.max_total_len = cap
            seqs.append(x)
            s.add(x)
        for _ in range(20_000):
            if not s.has_work:
                break
            fake_step(s)
        assert not s.has_work, f"trial {trial} did not finish"
        assert blocks.num_free == blocks.num_blocks
        assert all(x.finish_reason is FinishReason.LENGTH for x in seqs)


def test_abort_frees_blocks_wherever_the_request_is():
    s = Scheduler(BlockManager(10, 4), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(seq("run", 9))
    fake_step(s)
    s.add(seq("wait", 3))
    assert s.blocks.num_free == 10 - 3
    assert s.abort("run").finish_reason is FinishReason.CANCELLED
    assert s.abort("wait") is not None
    assert s.blocks.num_free == 10 and not s.has_work
    assert s.abort("unknown") is None


def test_a_recomputed_sequence_waits_for_room_for_its_whole_context():
    """Preempted by recompute, a sequence comes back with its whole context to compute again, in
    chunks of the step budget. Admitted when only its first chunk fits, it is the newest running
    sequence, so the next block shortage preempts it again before it is done, and its chunk's
    work is lost, over and over. It is admitted only when all of it fits: every sequence is
    preempted at most once in this cache, and no preempted sequence loses a prefill in progress."""
    s = Scheduler(BlockManager(64, 4), max_num_seqs=16, max_num_batched_tokens=16)
    seqs = [seq(f"r{i}", 24, max_tokens=40) for i in range(8)]  # 8 x 64 tokens: 2x the 256 slots
    for x in seqs:
        s.add(x)
    lost_prefills = 0
    while s.has_work:
        out = s.schedule()
        lost_prefills += sum(x.num_computed < x.length - 1 for x in out.preempted if x.num_preemptions > 1)
        s.finish_step(out, {i: 7 for i, c in enumerate(out.chunks) if c.samples})
    assert all(x.num_output == 40 for x in seqs)
    assert s.preempted_recompute > 0 and max(x.num_preemptions for x in seqs) <= 1
    assert lost_prefills == 0
