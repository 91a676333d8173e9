"""The FP8 KV cache on the CPU: the quantize/dequantize arithmetic, the cache's storage and scales,
the decode op over it, and (where Triton is installed) the CUDA kernels run by Triton's interpreter."""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch

from tandem.service.engine.ops.attention_ref import decode_attention
from tandem.service.engine.ops.decode_op import paged_decode
from tandem.service.engine.ops.kv_cache import CacheShape, KVCache
from tandem.service.engine.ops.kv_quant import (
    FP8,
    FP8_MAX,
    as_bytes,
    dequantize,
    quantize,
    round_trip,
    select,
    storage_dtype,
    write,
)

CPU = torch.device("cpu")


# --- the arithmetic -------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.0])
def test_a_round_trip_is_within_e4m3_precision_and_applies_the_scale(scale):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4 * scale
    s = torch.tensor(scale)
    q = quantize(x, s)
    assert q.dtype == FP8
    back = dequantize(q, s, torch.float32)
    # e4m3: 3 mantissa bits, a relative step of 2**-3, so round-to-nearest is within half of it;
    # values under e4m3's least normal (2**-6 of the scale) are within half its least subnormal step
    bound = torch.maximum(x.abs() * 2**-4, torch.tensor(2**-10 * scale))
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back, q.float() * scale)  # stored values are x / scale
    assert torch.equal(round_trip(x, s), back)


def test_values_past_e4m3s_range_saturate_instead_of_overflowing():
    s = torch.tensor(0.5)
    x = torch.tensor([1e4, -1e4, 224.0, -300.0, float("inf")])
    back = dequantize(quantize(x, s), s, torch.float32)
    assert back.tolist() == [FP8_MAX * 0.5, -FP8_MAX * 0.5, 224.0, -FP8_MAX * 0.5, FP8_MAX * 0.5]


def test_dequantize_rounds_to_the_models_dtype_once():
    s = torch.tensor(0.1)
    q = quantize(torch.randn(256), s)
    assert torch.equal(dequantize(q, s, torch.bfloat16), (q.float() * 0.1).to(torch.bfloat16))


def test_writes_and_gathers_move_the_stored_bytes():
    """index_copy_ has no float8 kernel on the CPU: writes and gathers go through uint8 views."""
    cache = torch.zeros(10, 2, 8, dtype=FP8)
    values = torch.randn(3, 2, 8)
    slots = torch.tensor([7, 2, 5])
    s = torch.tensor(0.25)
    write(cache, slots, values, s)
    assert torch.equal(as_bytes(select(cache, slots)), as_bytes(quantize(values, s)))
    assert not as_bytes(cache)[[0, 1, 3, 4, 6, 8, 9]].any()
    plain = torch.zeros(10, 2, 8)
    write(plain, slots, values, None)
    assert torch.equal(plain[slots], values) and select(plain, slots).dtype == torch.float32


def test_the_storage_dtype_follows_the_setting_and_rejects_others():
    assert storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert storage_dtype("fp8", torch.bfloat16) == FP8
    with pytest.raises(ValueError, match="'auto', 'fp8'"):
        storage_dtype("int8", torch.bfloat16)


# --- the cache ----------------------------------------------------------------------------------


SHAPE = CacheShape(num_layers=3, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_an_fp8_cache_stores_e4m3_with_a_scale_per_layer(layout):
    cache = KVCache(SHAPE, 8, 16, torch.bfloat16, CPU, layout, kv_cache_dtype="fp8")
    assert cache.quantized and cache.k_store.dtype == cache.v_store.dtype == FP8
    assert cache.dtype == torch.bfloat16  # what reads give back
    assert cache.k_scale.tolist() == cache.v_scale.tolist() == [1.0, 1.0, 1.0]
    k_scale, v_scale = cache.k_scale, cache.v_scale
    cache.set_scales(torch.tensor([0.5, 1.0, 2.0]), 0.25)  # per layer, or one for all
    assert cache.k_scale is k_scale and cache.v_scale is v_scale  # in place: graphs keep reading them
    assert cache.k_scale.tolist() == [0.5, 1.0, 2.0] and cache.v_scale.tolist() == [0.25] * 3
    with pytest.raises(ValueError, match="positive"):
        cache.set_scales(0.0, 1.0)


def test_a_cache_in_the_models_dtype_has_no_scales():
    cache = KVCache(SHAPE, 8, 16, torch.bfloat16, CPU)
    assert not cache.quantized and cache.k_store.dtype == torch.bfloat16 and cache.k_scale is None
    with pytest.raises(ValueError, match="no scales"):
        cache.set_scales(1.0, 1.0)


def test_an_fp8_cache_holds_twice_the_blocks_of_a_bf16_one_in_the_same_memory():
    budget = 3 * 2**20
    bf16 = KVCache.blocks_for_budget(SHAPE, 16, storage_dtype("auto", torch.bfloat16), budget)
    fp8 = KVCache.blocks_for_budget(SHAPE, 16, storage_dtype("fp8", torch.bfloat16), budget)
    assert fp8 == 2 * bf16 > 0
    full = KVCache(SHAPE, fp8, 16, torch.bfloat16, CPU, kv_cache_dtype="fp8")
    used = full.k_store.nbytes + full.v_store.nbytes  # the scratch block besides
    assert used == (fp8 + 1) * 16 * SHAPE.bytes_per_token(FP8) <= budget + 16 * SHAPE.bytes_per_token(FP8)


# --- the decode op --------------------------------------------------------------------------------


def _decode_case(layout: str, dtype: torch.dtype, batch: int = 3, block: int = 16, max_len: int = 70):
    """A filled FP8 cache (scales other than 1), a decode step's inputs and what it must give: the
    float32 attention over the dequantized context, the step's own K/V as the cache stores them."""
    g = torch.Generator().manual_seed(11)
    heads = 8
    num_blocks = batch * -(-max_len // block) + 2
    cache = KVCache(CacheShape(2, 2, 16), num_blocks, block, dtype, CPU, layout, kv_cache_dtype="fp8")
    cache.set_scales(torch.tensor([0.03, 0.02]), torch.tensor([0.05, 0.04]))
    layer = 1
    slots_all = torch.arange(cache.k.shape[1])
    for store, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        values = torch.randn(len(slots_all), 2, 16, generator=g).to(dtype)
        write(store[layer], slots_all, values, scale[layer])
    lens = torch.tensor([max_len, 1, 33][:batch], dtype=torch.int32)
    width = -(-max_len // block)
    table = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width).to(torch.int32)
    last = (lens - 1).long()
    slot_mapping = table[torch.arange(batch), last // block].long() * block + last % block
    q = torch.randn(1, heads, batch, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, batch, 16, generator=g).to(dtype) for _ in "kv")
    # the reference: the cache with the new K/V written (quantized), every value dequantized to the
    # model's dtype as the op reads it, attended in float32
    ks, vs = cache.k_scale[layer], cache.v_scale[layer]
    stored_k, stored_v = cache.k[layer].clone(), cache.v[layer].clone()
    write(stored_k, slot_mapping, k[0].transpose(0, 1), ks)
    write(stored_v, slot_mapping, v[0].transpose(0, 1), vs)
    slots_of = (table[:, :, None].long() * block + torch.arange(block)).view(batch, -1)
    mask = torch.arange(width * block)[None, :] < lens[:, None]
    ref = decode_attention(q[0].transpose(0, 1).float(), dequantize(stored_k[slots_of], ks, dtype).float(),
                           dequantize(stored_v[slots_of], vs, dtype).float(), mask, 16**-0.5)
    args = (q, k, v, cache.k_store, cache.v_store, layer, slot_mapping, table, lens, block, 16**-0.5,
            cache.head_major)
    return cache, args, ref, (stored_k, stored_v)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_op_attends_over_the_dequantized_cache(layout, dtype):
    cache, args, ref, (stored_k, stored_v) = _decode_case(layout, dtype)
    out = paged_decode(*args, k_scale=cache.k_scale, v_scale=cache.v_scale)
    assert out.dtype == dtype and out.shape == (1, 3, 8, 16)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out[0].float(), ref, atol=tol, rtol=tol)
    # the step's K/V stored quantized, where they belong, and nothing else touched
    assert torch.equal(as_bytes(cache.k[1]), as_bytes(stored_k))
    assert torch.equal(as_bytes(cache.v[1]), as_bytes(stored_v))


# --- the CUDA decode kernel, run by Triton's interpreter on the CPU --------------------------------
# Reading only, in float32: the interpreter (Triton 3.9) computes bf16 matrix products wrongly (for a
# bf16 cache alike), rounds float32 to e4m3 wrongly where the rounding carries into the exponent, and
# cannot run the store of the step's own K/V; test_gpu_fp8_kv.py covers all of them on a GPU.


class _ReadCase(NamedTuple):
    """`_decode_case` as the kernel reads it (no new K/V): its query rows [B, H, D], the layer's scales,
    its context dequantized to float32 and the mask of its live positions."""

    q: torch.Tensor
    ks: torch.Tensor
    vs: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    scale: float
    kernel_args: tuple  # the cache's K and V, block table, lengths and block size

    def attention(self, q: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 attention of `q` (the case's own by default) over the dequantized context."""
        return decode_attention(self.q if q is None else q, self.keys, self.values, self.mask, self.scale)


def _read_case() -> _ReadCase:
    cache, args, _, _ = _decode_case("NHD", torch.float32)
    q, _, _, _, _, layer, _, table, lens, block, scale, _ = args
    ks, vs = cache.k_scale[layer], cache.v_scale[layer]
    slots_of = (table[:, :, None].long() * block + torch.arange(block)).view(len(lens), -1)
    mask = torch.arange(slots_of.shape[1])[None, :] < lens[:, None]
    keys = dequantize(cache.k[layer][slots_of], ks, torch.float32)
    values = dequantize(cache.v[layer][slots_of], vs, torch.float32)
    return _ReadCase(q[0].transpose(0, 1), ks, vs, keys, values, mask, scale,
                     (cache.k[layer], cache.v[layer], table, lens, block))


@pytest.mark.parametrize("splits", [1, 3])
def test_the_decode_kernel_reads_an_fp8_cache(splits):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 (Triton reads it when it is first imported)")
    from tandem.service.engine.ops.decode_grid import KernelConfig
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    c = _read_case()
    out = paged_decode_attention(c.q, *c.kernel_args, c.scale, splits, config=KernelConfig(tile=32),
                                 kv_scales=(c.ks, c.vs))
    torch.testing.assert_close(out, c.attention(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("qk", "pv"), [(False, True), (True, False), (True, True)], ids=["pv", "qk", "both"])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_decode_kernels_fp8_products_are_within_their_operands_rounding(splits, qk, pv):
    """`qk_fp8` / `pv_fp8` (Q.K^T / P.V with e4m3 operands): K / V as stored, each query row /
    probability rounded to e4m3, so the output is attention over the dequantized cache within
    that rounding (`fp8_products_bound`; here at a whole e4m3 step, 2^-3: the interpreter's float32
    to e4m3 may land a step off; test_gpu_fp8_kv.py holds a GPU to the rounding's own 2^-4), and
    not the unrounded product."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 (Triton reads it when it is first imported)")
    from tandem.service.engine.ops.attention_ref import fp8_products_bound
    from tandem.service.engine.ops.decode_grid import KernelConfig
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    c = _read_case()
    ref = c.attention()
    out = paged_decode_attention(c.q, *c.kernel_args, c.scale, splits,
                                 config=KernelConfig(tile=32, qk_fp8=qk, pv_fp8=pv), kv_scales=(c.ks, c.vs))
    bound = fp8_products_bound(c.q, c.keys, c.values, c.mask, c.scale, qk, pv, step=2**-3) + 1e-6
    assert ((out - ref).abs() <= bound).all(), ((out - ref).abs() - bound).max()
    assert (out - ref).abs().max() > 1e-4  # the operands were rounded


@pytest.mark.parametrize("splits", [1, 3])
def test_the_decode_kernels_float16_products_attend_over_the_dequantized_cache(splits):
    """`f16_products`: K and V widened from e4m3 unscaled, the query and probabilities in float16,
    the scales applied after the products: attention over the dequantized cache within float16's
    rounding of the query and the probabilities (a scale left out or applied twice is far off)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 (Triton reads it when it is first imported)")
    from tandem.service.engine.ops.decode_grid import KernelConfig
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    c = _read_case()
    q = c.q.to(torch.bfloat16)  # a float32 model's queries keep float32 products
    assert c.ks != 1 and c.vs != 1
    ref = c.attention(q.float())
    out = paged_decode_attention(q, *c.kernel_args, c.scale, splits,
                                 config=KernelConfig(tile=32, f16_products=True), kv_scales=(c.ks, c.vs))
    assert out.dtype == torch.bfloat16
    # float16's rounding of the probabilities, and the output's to bf16 (2^-9 of its largest)
    torch.testing.assert_close(out.float(), ref, atol=4e-3 * ref.abs().max().item(), rtol=0)


def test_the_decode_anatomys_parts_read_an_fp8_cache_as_the_engine():
    """The profile's anatomy kernel (bench/kernels/decode_anatomy.py) over an e4m3 cache: its
    whole-loop parts attend over the dequantized context (what the engine's kernel computes), and
    its `dequant` part adds up the dequantized K and V, so the times it reports are of that work."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 (Triton reads it when it is first imported)")
    from tandem.bench.kernels.decode_anatomy import WHOLE_LOOP, parts, run_part
    from tandem.service.engine.ops.decode_grid import Splits

    cache, args, _, _ = _decode_case("NHD", torch.float32)
    q, _, _, _, _, layer, _, table, lens, block, scale, _ = args
    q = q[0].transpose(0, 1).contiguous()
    ks, vs = cache.k_scale[layer], cache.v_scale[layer]
    k, v = cache.k[layer], cache.v[layer]
    slots_of = (table[:, :, None].long() * block + torch.arange(block)).view(len(lens), -1)
    live = torch.arange(slots_of.shape[1])[None, :] < lens[:, None]
    keys, values = dequantize(k[slots_of], ks, torch.float32), dequantize(v[slots_of], vs, torch.float32)
    ref = decode_attention(q, keys, values, live, scale)
    one = Splits(1, 1)
    # each mode and tile once (warps and stages are the compiler's, not the interpreter's)
    shapes = {(p.mode, p.tile): p for p in parts(kv_fp8=True)}
    assert {"dequant", "full", "fma"} <= {mode for mode, _ in shapes}
    for (mode, tile), part in shapes.items():
        if mode in WHOLE_LOOP:
            out = run_part(part, q, k, v, table, lens, block, scale, one, kv_scales=(ks, vs))[:, :, 0]
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"{mode}, tile {tile}")
    sums = ((keys + values) * live[:, :, None, None]).sum(1).repeat_interleave(q.shape[1] // k.shape[1], 1)
    dequant = run_part(shapes["dequant", 32], q, k, v, table, lens, block, scale, one, kv_scales=(ks, vs))
    torch.testing.assert_close(dequant[:, :, 0], sums, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="e4m3 cache"):
        run_part(shapes["dequant", 32], q, k, v, table, lens, block, scale, one)
    # `words` reads the same bytes four to a 32-bit element
    words = [w.view(torch.int32)[slots_of].double() for w in (k, v)]
    word_sums = ((words[0] + words[1]) * live[:, :, None, None]).sum(1).repeat_interleave(
        q.shape[1] // k.shape[1], 1)
    out = run_part(shapes["words", 32], q, k, v, table, lens, block, scale, one, kv_scales=(ks, vs))
    torch.testing.assert_close(out[:, :, 0, :k.shape[-1] // 4].double(), word_sums, atol=0, rtol=1e-5)
