"""The mixed attention op (ops/mixed_op.py) on the CPU: a step's decode rows and prompt chunks,
each token attending to its own sequence's context, whatever the order of the step's rows."""

from __future__ import annotations

import math
from array import array

import pytest
import torch

from tandem.service.contract import Request
from tandem.service.engine.batch import build_attention_metadata
from tandem.service.engine.batch_builder import StepInputsBuilder
from tandem.service.engine.ops.deferred_rotary import DeferredRotary, rotate
from tandem.service.engine.ops.kv_cache import CacheShape, KVCache
from tandem.service.engine.ops.kv_quant import round_trip, write
from tandem.service.engine.ops.mixed_op import attending, paged_mixed
from tandem.service.engine.scheduler import ScheduledChunk
from tandem.service.engine.sequence import Sequence
from tandem.service.engine.step_buffers import StepBuffers

HEADS, KV_HEADS, DIM = 4, 2, 16  # the CUDA kernels take heads of 16 dimensions or more
# (name, tokens computed before the step, tokens computed in it): decodes, a chunk after a cached
# prefix, a fresh prompt
SEQUENCES = [("a", 9, 1), ("b", 8, 5), ("c", 0, 6), ("d", 6, 1)]
COMPUTED = {name: done for name, done, _ in SEQUENCES}
# the deferred model's rotary embedding (Q and K come unrotated; the op rotates them)
ROTARY = DeferredRotary(1.0 / 10000.0 ** (torch.arange(0, DIM, 2).float() / DIM), 1.0)
# an FP8 cache's scales: K/V of magnitude ~3 stored as up to ~150 and ~75, within e4m3's 448
FP8_SCALES = (0.02, 0.04)


def _step(order: list[str], device: torch.device, dtype: torch.dtype, block: int,
          kv_cache_dtype: str = "auto"):
    """The step's chunks in this order, on fresh sequences over scattered blocks of a fresh cache
    whose computed K/V are each position's own random values (quantized, in an FP8 cache)."""
    cache = KVCache(CacheShape(1, KV_HEADS, DIM), 64, block, dtype, device, kv_cache_dtype=kv_cache_dtype)
    if cache.quantized:
        cache.set_scales(*FP8_SCALES)
    g = torch.Generator().manual_seed(0)
    free = torch.randperm(64, generator=g).tolist()
    seqs = {}
    for name, done, new in SEQUENCES:
        seq = Sequence(Request(name, list(range(done + new))), list(range(done + new)), done + new, seed=0,
                       max_total_len=99)
        seq.block_ids = array("i", [free.pop() for _ in range(-(-(done + new) // block))])
        seqs[name] = seq
    for name, done, _ in SEQUENCES:  # what earlier steps wrote
        for p in range(done):
            slot = seqs[name].block_ids[p // block] * block + p % block
            if cache.quantized:  # written as the op writes them: the model's dtype, then e4m3
                k, v = (t.to(device, dtype)[None] for t in _kv(name, p))
                write(cache.k[0], torch.tensor([slot], device=device), k, cache.k_scale[0])
                write(cache.v[0], torch.tensor([slot], device=device), v, cache.v_scale[0])
            else:
                cache.k[0, slot], cache.v[0, slot] = _kv(name, p)  # cast to the cache's dtype
    chunks = [ScheduledChunk(seqs[n], done, new, samples=True) for n in order
              for name, done, new in SEQUENCES if name == n]
    return cache, chunks


def _kv(name: str, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * ord(name) + pos)
    return torch.randn(KV_HEADS, DIM, generator=g), torch.randn(KV_HEADS, DIM, generator=g)


def _q(name: str, pos: int) -> torch.Tensor:
    return torch.randn(HEADS, DIM, generator=torch.Generator().manual_seed(7000 * ord(name) + pos))


def _run(order: list[str], device: torch.device, dtype: torch.dtype = torch.float32, block: int = 4,
         rotary: DeferredRotary | None = None, kv_cache_dtype: str = "auto",
         ) -> tuple[dict[tuple[str, int], torch.Tensor], int | None]:
    """Each (sequence, position)'s attention output in a step of this row order. On CUDA, as the
    runner runs a mixed step: the step's K/V written by one kernel, the decode rows by the Triton
    kernel in place, the prompt chunks by one flash-attention call. `rotary`: Q and the new K
    handed over unrotated, as by the deferred model."""
    cache, chunks = _step(order, device, dtype, block, kv_cache_dtype)
    batch = StepInputsBuilder(block).build(chunks)
    buf = StepBuffers(64, 8, 8, device, cache.scratch_block, block)
    kernel = varlen = None
    if device.type == "cuda":
        from tandem.service.engine.ops.decode_op import num_sms
        from tandem.service.engine.ops.triton_decode import DecodeKernel

        rows = len(batch.decode_token_idx)
        if rows:
            longest = int(batch.decode_ctx_lens.max())
            kernel = DecodeKernel.for_batch(cache, rows, num_sms(device.index or 0), longest)
        varlen = buf.stage
    if rotary is not None:
        rotary = DeferredRotary(rotary.inv_freq.to(device), rotary.scaling)
    meta = build_attention_metadata(batch, buf.upload(batch), cache, None, kernel, varlen=varlen,
                                    rotary=rotary)
    tokens = [(c.seq.request_id, p) for c in chunks for p in range(c.start, c.start + c.num_tokens)]
    q = torch.stack([_q(*t) for t in tokens], 1)[None].to(device, dtype)  # [1, H, T, D]
    k = torch.stack([_kv(*t)[0] for t in tokens], 1)[None].to(device, dtype)  # [1, Hkv, T, D]
    v = torch.stack([_kv(*t)[1] for t in tokens], 1)[None].to(device, dtype)
    with attending(meta):
        fp8 = {"k_scale": cache.k_scale, "v_scale": cache.v_scale} if cache.quantized else {}
        out = paged_mixed(q, k, v, cache.k_store, cache.v_store, 0, cache.head_major, DIM**-0.5, **fp8)
    assert (meta.varlen is not None) == (varlen is not None and bool(batch.prefills))
    return {t: out[0, i].float().cpu() for i, t in enumerate(tokens)}, meta.num_decode_first


def _reference(name: str, pos: int, dtype: torch.dtype = torch.float32, rotary: bool = False,
               fp8: bool = False) -> torch.Tensor:
    """fp32 attention of the inputs as the op got them (rounded to `dtype`); with `rotary`, the
    query and the step's new keys rotated at their positions (the cached keys were, when written);
    with `fp8`, every key and value as an FP8 cache of FP8_SCALES gives it back."""
    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).float()

    def rotated(t: torch.Tensor, p: int) -> torch.Tensor:  # [heads, D] at position p
        return rotate(torch.tensor([p]), ROTARY, rounded(t)[None])[0][0] if rotary else rounded(t)

    def stored(t: torch.Tensor, scale: float) -> torch.Tensor:  # as the cache gives it back
        return round_trip(t.to(dtype), torch.tensor(scale)).float() if fp8 else t

    keys = torch.stack([rotated(_kv(name, p)[0], p) if p >= COMPUTED[name] else rounded(_kv(name, p)[0])
                        for p in range(pos + 1)])  # [ctx, Hkv, D]
    keys = stored(keys, FP8_SCALES[0])
    values = stored(rounded(torch.stack([_kv(name, p)[1] for p in range(pos + 1)])), FP8_SCALES[1])
    group = HEADS // KV_HEADS
    q = rotated(_q(name, pos), pos)
    out = []
    for h in range(HEADS):
        w = torch.softmax(keys[:, h // group] @ q[h] / math.sqrt(DIM), 0)
        out.append(w @ values[:, h // group])
    return torch.stack(out)


ORDERS = pytest.mark.parametrize(
    "order, decode_first",
    [(["a", "d", "b", "c"], 2), (["b", "c"], 0), (["b", "a", "c", "d"], None), (["c", "d", "b"], None)],
    ids=["decodes-first", "prompts-only", "interleaved", "decode-between"],
)


ROTARIES = pytest.mark.parametrize("rotary", [False, True], ids=["rotated-by-model", "rotated-by-op"])


@ROTARIES
@ORDERS
def test_each_token_attends_to_its_own_context_in_any_row_order(order, decode_first, rotary):
    """Decode rows first (each part of the step a slice of its rows) or among the prompt chunks
    (gathered and scattered by index): every token's output is its attention over its own
    sequence's context, the step's new K/V included (rotated by the op at each token's position,
    where the model leaves the rotary embedding to it)."""
    got, first = _run(order, torch.device("cpu"), rotary=ROTARY if rotary else None)
    assert first == decode_first  # which of the two paths ran
    for (name, pos), out in got.items():
        torch.testing.assert_close(out, _reference(name, pos, rotary=rotary), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@ROTARIES
@ORDERS
def test_each_token_attends_to_its_own_context_on_cuda(order, decode_first, rotary):
    """The same through the CUDA path of a mixed step (fp16, 16-token blocks): the step's K/V
    written (and Q and K rotated) by one kernel, the decode kernel reading K/V in place and one
    flash-attention call for the prompt chunks."""
    got, first = _run(order, torch.device("cuda"), torch.float16, 16, ROTARY if rotary else None)
    assert first == decode_first
    for (name, pos), out in got.items():
        torch.testing.assert_close(out, _reference(name, pos, torch.float16, rotary), atol=2e-3, rtol=2e-3)


@ROTARIES
@ORDERS
def test_an_fp8_cache_gives_every_token_its_context_as_stored(order, decode_first, rotary):
    """With an FP8 cache (scales other than 1), every token attends to K/V as the cache holds them,
    quantized and dequantized, a fresh prompt's own K/V included: the reference's attention over
    the round-tripped values, to float32 precision."""
    got, first = _run(order, torch.device("cpu"), rotary=ROTARY if rotary else None, kv_cache_dtype="fp8")
    assert first == decode_first
    for (name, pos), out in got.items():
        torch.testing.assert_close(out, _reference(name, pos, rotary=rotary, fp8=True), atol=1e-5, rtol=1e-5)
    # and the cache did quantize: not what the unquantized cache gives
    assert any(not torch.allclose(out, _reference(*t, rotary=rotary), atol=1e-3) for t, out in got.items())


@pytest.mark.gpu
@ROTARIES
@ORDERS
def test_an_fp8_cache_gives_every_token_its_context_as_stored_on_cuda(order, decode_first, rotary):
    """The same through the CUDA path (bf16, 16-token blocks): the write kernel quantizes, the
    decode kernel and the flash-attention gather dequantize."""
    got, first = _run(order, torch.device("cuda"), torch.bfloat16, 16, ROTARY if rotary else None, "fp8")
    assert first == decode_first
    # the kernels rotate in fp32 and round once, transformers after each op: a key near an e4m3
    # rounding boundary may land one e4m3 step away, hence more than bf16's tolerance
    for (name, pos), out in got.items():
        ref = _reference(name, pos, torch.bfloat16, rotary, fp8=True)
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
