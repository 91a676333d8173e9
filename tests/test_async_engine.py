"""The engine front with its real core thread: streaming, seeds, stop strings, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.service.engine.factory import build_engine
from tandem.service.engine.sequence import FinishReason
from tandem.service.engine.validation import resolve_params
from tandem.service.models.loader import load_model
from tandem.service.settings import ServerSettings


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    import torch

    return load_model(str(tiny_model_dir("llama")), "tiny", torch.device("cpu"))


def _engine(loaded, **overrides):
    settings = ServerSettings(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, **overrides)
    return build_engine(loaded, settings)


async def _collect(engine, prompt, params):
    chunks = [c async for c in await engine.generate(prompt, params)]
    return [t for c in chunks for t in c.token_ids], chunks


def test_seeded_sampling_is_reproducible_with_different_batch_mates(loaded):
    async def main():
        engine = _engine(loaded)
        engine.start()
        try:
            prompt = list(range(10, 30))
            params = resolve_params(
                engine.limits, len(prompt), temperature=1.0, seed=42, max_tokens=16, ignore_eos=True
            )
            alone, _ = await _collect(engine, prompt, params)
            mates = [
                resolve_params(engine.limits, 5, temperature=1.3, max_tokens=30, ignore_eos=True)
                for _ in range(3)
            ]
            results = await asyncio.gather(
                _collect(engine, prompt, params),
                *[_collect(engine, [7, 8, 9, 10 + i, 11], m) for i, m in enumerate(mates)],
            )
            other_seed = resolve_params(
                engine.limits, len(prompt), temperature=1.0, seed=43, max_tokens=16, ignore_eos=True
            )
            different, _ = await _collect(engine, prompt, other_seed)
            return alone, results[0][0], different
        finally:
            engine.stop()

    alone, crowded, different = asyncio.run(main())
    assert alone == crowded
    assert len(alone) == 16
    assert different != alone


def test_cancelling_a_stream_frees_its_kv_blocks(loaded):
    async def main():
        engine = _engine(loaded)
        engine.start()
        try:
            params = resolve_params(engine.limits, 8, max_tokens=200, ignore_eos=True)
            stream = await engine.generate(list(range(8)), params)
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.aclose()
            during = engine.core.stats()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                s = engine.core.stats()
                if s.running == 0 and s.kv_blocks_free == s.kv_blocks_total:
                    return during, s
                await asyncio.sleep(0.05)
            return during, engine.core.stats()
        finally:
            engine.stop()

    _, after = asyncio.run(main())
    assert after.running == 0 and after.waiting == 0
    assert after.kv_blocks_free == after.kv_blocks_total


def test_stop_string_ends_generation_and_is_not_in_the_text(loaded):
    async def main():
        engine = _engine(loaded)
        engine.start()
        try:
            prompt = list(range(40, 60))
            free = resolve_params(engine.limits, len(prompt), max_tokens=40, ignore_eos=True)
            full = await engine.generate_all(prompt, free)
            # pick a stop string from the middle of the greedy text: generation must end right before it
            text = full.text
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            assert stop.strip(), "need a visible stop string"
            params = resolve_params(engine.limits, len(prompt), max_tokens=40, ignore_eos=True, stop=[stop])
            cut = await engine.generate_all(prompt, params)
            return full, cut, stop, engine.core.stats()
        finally:
            engine.stop()

    full, cut, stop, stats = asyncio.run(main())
    assert cut.finish_reason is FinishReason.STOP and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert full.finish_reason is FinishReason.LENGTH and len(full.token_ids) == 40
    assert cut.completion_tokens < 40


def test_queue_bound_gives_resource_exhausted(loaded):
    from tandem.service.engine.errors import ErrorKind, RequestError

    async def main():
        engine = _engine(loaded, max_waiting_requests=1)
        # the core thread is not started: requests stay queued
        engine._loop = asyncio.get_running_loop()
        p = resolve_params(engine.limits, 3, max_tokens=2)
        first = await engine.generate([1, 2, 3], p)
        task = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0.01)
        engine.core.drain_inbox(block=False)
        with pytest.raises(RequestError) as exc:
            await engine.generate([1, 2, 3], p)
        task.cancel()
        return exc.value

    err = asyncio.run(main())
    assert err.kind is ErrorKind.RESOURCE_EXHAUSTED
