"""The FP8 KV cache on CUDA (on a GPU: -m gpu): the Triton decode and K/V write kernels against a
float32 reference over the dequantized cache, and engines whose paths over an FP8 cache agree."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_config
from engine_harness import Arrival, make_core, run
from transformers import AutoModelForCausalLM

from tandem.service.contract import SamplingParams
from tandem.service.engine.ops.attention_ref import decode_attention, fp8_products_bound
from tandem.service.engine.ops.decode_grid import (
    ENGINE_CONFIGS,
    KernelConfig,
    Splits,
    engine_configs,
    num_splits_for,
    product_variants,
    register_capped,
)
from tandem.service.engine.ops.deferred_rotary import DeferredRotary, rotate
from tandem.service.engine.ops.fp8_linear import quantize_rows
from tandem.service.engine.ops.kv_quant import FP8, as_bytes, dequantize, quantize, select, write

pytestmark = pytest.mark.gpu

K_SCALE, V_SCALE = 0.03, 0.05  # K/V of magnitude ~4 stored up to ~130 and ~80: inside e4m3's 448
# (batch, query heads, KV heads, head_dim, block_size, longest context): GQA groups 1, 4 and 8,
# blocks of 16 and 32, contexts up to 16K
SHAPES = [(1, 32, 8, 128, 16, 16384), (7, 8, 8, 64, 16, 300), (32, 32, 8, 128, 16, 1500),
          (4, 32, 4, 128, 32, 16384), (64, 32, 4, 128, 32, 257), (3, 64, 8, 128, 32, 5000),
          (2, 8, 1, 64, 16, 9000)]


def _rotate_as_the_kernels(positions: torch.Tensor, rotary: DeferredRotary, *xs: torch.Tensor
                           ) -> tuple[torch.Tensor, ...]:
    """The kernels' rotary arithmetic (triton_rotary.rotary_cos_sin): cos and sin rounded to x's
    dtype as transformers rounds them, then x * cos + rotate_half(x) * sin in float32, rounded once
    to x's dtype. transformers rounds each product and the sum to x's dtype: where the two products
    nearly cancel, the two differ by about |x| * 2^-8 in bf16, many e4m3 steps of a small key."""
    angles = positions.float()[:, None] * rotary.inv_freq.to(positions.device)[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [B, 1, D]
    dtype = xs[0].dtype
    cos = (angles.cos() * rotary.scaling).to(dtype).float()
    sin = (angles.sin() * rotary.scaling).to(dtype).float()
    half = xs[0].shape[-1] // 2

    def one(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return (x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin).to(dtype)

    return tuple(one(x) for x in xs)


def _product_magnitude(x: torch.Tensor, positions: torch.Tensor, rotary: DeferredRotary) -> torch.Tensor:
    """|x * cos| + |x_pair * sin| in float32: the size of the two products a rotated value sums."""
    angles = positions.float()[:, None] * rotary.inv_freq.to(positions.device)[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    half = x.shape[-1] // 2
    xf = x.float()
    pair = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
    return ((xf * angles.cos()).abs() + (pair * angles.sin()).abs()) * rotary.scaling


def _rotated_as_expected(got: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                         rotary: DeferredRotary) -> None:
    """`got`, x rotated by a kernel: the kernels' arithmetic within one step of x's dtype (plus a
    float32 multiply-add's rounding of the products), and transformers' (deferred_rotary.rotate)
    within its rounding of the two products and their sum in x's dtype."""
    magnitude = _product_magnitude(x, positions, rotary)
    tiny = torch.finfo(x.dtype).tiny
    ours = _rotate_as_the_kernels(positions, rotary, x)[0].float()
    bound = torch.finfo(x.dtype).eps * ours.abs() + 2 * torch.finfo(torch.float32).eps * magnitude + tiny
    excess = ((got.float() - ours).abs() - bound).max().item()
    assert excess <= 0, f"beyond the kernels' arithmetic by {excess}"
    theirs = rotate(positions, rotary, x)[0].float()
    bound = 4 * torch.finfo(x.dtype).eps * magnitude + tiny
    excess = ((got.float() - theirs).abs() - bound).max().item()
    assert excess <= 0, f"beyond the rounding of transformers' products by {excess}"


def _one_step_apart(got: torch.Tensor, want: torch.Tensor, scale: float) -> None:
    """Stored e4m3 values equal, or one e4m3 step apart: the kernels' float32 sums may fuse a
    multiply-add the reference rounds, so a key next to a rounding boundary may fall on its other
    side (one step of the model's dtype, at most one e4m3 step)."""
    g, w = got.float() * scale, want.float() * scale
    torch.testing.assert_close(g, w, rtol=2**-3, atol=2**-9 * scale)


@pytest.mark.parametrize("rotary", [False, True], ids=["rotated-by-model", "rotated-by-kernel"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, block_size, max_len", SHAPES)
def test_decode_kernel_over_an_fp8_cache_matches_the_dequantized_reference(
    batch, heads, kv_heads, head_dim, block_size, max_len, dtype, layout, rotary
):
    """Random inputs, blocks scattered over the cache, every split count and configuration the
    engine may pick (and the step's own token after the loop): the output is float32 attention over
    the dequantized cache, the step's K/V as the kernel stored them; the kernel stores them as the
    torch path does (kv_quant.write)."""
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(batch * 1000 + max_len)
    num_blocks = batch * (-(-max_len // block_size)) + 8
    slots = num_blocks * block_size
    ks, vs = (torch.tensor(s, device="cuda") for s in (K_SCALE, V_SCALE))

    def cache(scale: torch.Tensor) -> torch.Tensor:  # [slots, Hkv, D] e4m3 over either storage
        values = torch.randn(slots, kv_heads, head_dim, device="cuda", generator=g) * 2
        if layout == "NHD":
            return quantize(values, scale)
        return quantize(values.transpose(0, 1).contiguous(), scale).transpose(0, 1)

    k_cache, v_cache = cache(ks), cache(vs)
    lens = torch.randint(1, max_len + 1, (batch,), device="cuda", generator=g)
    lens[0] = max_len
    if batch > 1:
        lens[1] = 1
    width = -(-max_len // block_size)
    table = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * width].view(batch, width)
    q = torch.randn(heads, batch, head_dim, device="cuda", generator=g).to(dtype).transpose(0, 1)
    new_k, new_v = (torch.randn(kv_heads, batch, head_dim, device="cuda", generator=g)
                    .to(dtype).transpose(0, 1) for _ in "kv")
    last = lens - 1
    new_slots = table[torch.arange(batch, device="cuda"), last // block_size].long() * block_size
    new_slots += last % block_size
    spec = None
    ref_q, ref_new_k = q, new_k
    if rotary:
        base = 500000.0 if head_dim == 128 else 10000.0
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
        spec = DeferredRotary(inv_freq, 1.0)
        ref_q, ref_new_k = _rotate_as_the_kernels(last, spec, q, new_k)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write(ref_k, new_slots, ref_new_k, ks)
    write(ref_v, new_slots, new_v, vs)
    scale = head_dim**-0.5
    slots_of = (table[:, :, None] * block_size + torch.arange(block_size, device="cuda")).view(batch, -1)
    pos = torch.arange(width * block_size, device="cuda")
    context = (batch, -1, kv_heads, head_dim)
    keys = dequantize(select(ref_k, slots_of.flatten()), ks, dtype).float().view(context)
    values = dequantize(select(ref_v, slots_of.flatten()), vs, dtype).float().view(context)
    live = pos[None, :] < lens[:, None]
    ref = decode_attention(ref_q.float(), keys, values, live, scale)
    tol = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}[dtype] * (2 if rotary else 1)

    def fp8_products(config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The products with e4m3 operands: attention with the query rounded per row as the
        kernel rounds it (qk_fp8), and the bound of the probabilities' rounding (pv_fp8)."""
        q_taken = ref_q.float()
        if config.qk_fp8:
            q8, q_scale = quantize_rows(q_taken)
            q_taken = q8.float() * q_scale
        want = decode_attention(q_taken, keys, values, live, scale)
        return want, fp8_products_bound(q_taken, keys, values, live, scale, qk=False, pv=config.pv_fp8)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    step_sized = num_splits_for(batch, kv_heads, sms, longest=max_len)
    configs = {*ENGINE_CONFIGS, KernelConfig(tile=16), KernelConfig(tile=64, stages=2, new_after_loop=True),
               KernelConfig(tile=64, single_split_direct=True),
               *product_variants(ENGINE_CONFIGS), *register_capped(engine_configs(kv_fp8=True))}
    outs = {}
    for splits in {1, step_sized, 32, Splits(1, 32), Splits(2, 5)}:
        for config in configs:
            k_run, v_run = k_cache.clone(), v_cache.clone()
            out = paged_decode_attention(q, k_run, v_run, table, lens, block_size, scale, splits,
                                         (new_k, new_v, new_slots), spec, config=config, kv_scales=(ks, vs))
            assert out.dtype == dtype
            if config.pv_fp8 or config.qk_fp8:
                want, rounding = fp8_products(config)
                excess = ((out.float() - want).abs() - rounding - tol * want.abs().max()).max().item()
                assert excess <= 0, f"splits={splits}, {config}: beyond the rounding by {excess}"
            else:
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < tol, f"splits={splits}, {config}: relative error {err}"
            assert torch.equal(as_bytes(v_run), as_bytes(ref_v)), f"splits={splits}, {config}"
            if rotary:
                _one_step_apart(k_run, ref_k, K_SCALE)
            else:
                assert torch.equal(as_bytes(k_run), as_bytes(ref_k)), f"splits={splits}, {config}"
            outs[splits, config] = out
    # whichever split owns the step's token, it is used as stored: a sequence of one split in a grid
    # of many gets the one-split grid's bits (the merge's sums are of the same values), in every
    # configuration the engine picks
    alone = torch.tensor([Splits(1, 32).of(int(n)) == 1 for n in lens], device="cuda")
    assert alone.any() or batch == 1
    for config in engine_configs(kv_fp8=True):
        assert torch.equal(outs[1, config][alone], outs[Splits(1, 32), config][alone]), config


WRITE_SHAPES = [(2048, 32, 8, 128), (37, 32, 4, 128), (5, 8, 8, 64), (300, 8, 1, 128), (1, 4, 1, 128)]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("rotary", [False, True], ids=["store-only", "rotates"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", WRITE_SHAPES)
def test_write_kernel_quantizes_the_steps_kv_into_an_fp8_cache(tokens, heads, kv_heads, head_dim, dtype,
                                                               rotary, layout):
    """Each token's K (rotated where asked) and V land quantized in its slot, as kv_quant.write
    stores them, nowhere else; the queries and the keys handed back stay in the model's dtype."""
    from tandem.service.engine.ops.triton_kv_write import write_step_kv

    g = torch.Generator(device="cuda").manual_seed(tokens * 7 + heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=g).to(dtype) * 3
    q, k, v = (part.view(tokens, -1, head_dim) for part in
               qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    slots = 4 * tokens + 64

    def cache() -> torch.Tensor:
        if layout == "NHD":
            return torch.zeros(slots, kv_heads, head_dim, device="cuda", dtype=FP8)
        return torch.zeros(kv_heads, slots, head_dim, device="cuda", dtype=FP8).transpose(0, 1)

    k_cache, v_cache = cache(), cache()
    slot_mapping = torch.randperm(slots, device="cuda", generator=g)[:tokens]
    positions = torch.randint(0, 40000, (tokens,), device="cuda", generator=g)
    ks, vs = (torch.tensor(s, device="cuda") for s in (K_SCALE, V_SCALE))
    spec = None
    ref_k = k
    if rotary:
        inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
        spec = DeferredRotary(inv_freq, 1.25)
        (ref_k,) = _rotate_as_the_kernels(positions, spec, k)
    ref_k_cache, ref_v_cache = cache(), cache()
    write(ref_k_cache, slot_mapping, ref_k, ks)
    write(ref_v_cache, slot_mapping, v, vs)
    out, keys = write_step_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, spec, keys=True,
                              kv_scales=(ks, vs))
    assert torch.equal(as_bytes(v_cache), as_bytes(ref_v_cache))
    if rotary:
        _rotated_as_expected(out, q, positions, spec)
        assert keys.dtype == dtype
        _rotated_as_expected(keys, k, positions, spec)
        _one_step_apart(k_cache, ref_k_cache, K_SCALE)
        # the keys handed back are those stored, before quantization
        assert torch.equal(as_bytes(select(k_cache, slot_mapping)), as_bytes(quantize(keys, ks)))
    else:
        assert out is q and keys is k
        assert torch.equal(as_bytes(k_cache), as_bytes(ref_k_cache))


def test_an_fp8_engine_with_graphs_gives_the_eager_engines_tokens():
    """The CUDA engine over an FP8 cache (CUDA graphs, async loop, packed prompt chunks, preemption
    in a small cache) gives the tokens of the eager engine over the same FP8 cache: the same kernels
    on the same values, the scales read through the graphs as tensors."""
    torch.manual_seed(0)
    config = make_tiny_config("llama", 1000)
    model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    rng = random.Random(1)
    arrivals = [Arrival(f"r{i}", [rng.randrange(1000) for _ in range(n)], SamplingParams(max_tokens=24), at)
                for i, (n, at) in enumerate(zip([7, 60, 2, 33, 15, 90], [0, 0, 1, 3, 8, 12], strict=True))]
    results = []
    for served in (True, False):
        core = make_core(model, num_blocks=12, block_size=16, max_num_batched_tokens=64, max_model_len=160,
                         max_num_seqs=8, cuda_graphs=served, step_loop="async" if served else "sync",
                         kv_cache_dtype="fp8")
        assert core.runner.cache.k_store.dtype == FP8
        core.runner.cache.set_scales(0.5, 0.25)  # after capture: the graphs read the new values
        results.append(run(core, arrivals))
    assert results[0].preemptions > 0
    assert results[0].tokens == results[1].tokens


def test_a_mixed_step_over_an_fp8_cache_compiles_no_kernel_after_start_up():
    """`compile_step_variants` over an FP8 cache (queries in the model's dtype, layer 0's scales)
    compiles every variant the decode rows of a mixed step launch, for every layer's scales (each a
    4-byte step into the [layers] tensor: no alignment is specialised on)."""
    from tandem.service.engine.ops.triton_decode import compile_step_variants, paged_decode_attention
    from tandem.service.engine.ops.triton_variants import compiled_variants

    g = torch.Generator(device="cuda").manual_seed(3)
    kv_heads, heads, head_dim, block, width = 8, 32, 128, 16, 64
    k, v = (quantize(torch.randn(2 * width * block, kv_heads, head_dim, device="cuda", generator=g),
                     torch.tensor(0.05, device="cuda")) for _ in "kv")
    scales = torch.full((3,), 0.05, device="cuda")
    compile_step_variants(k, v, block, heads, width, torch.bfloat16, (scales[0], scales[0]))
    before = compiled_variants()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for layer in (1, 2):
        for batch in (1, 9, 64):
            table = torch.randint(0, 2 * width, (batch, width), device="cuda", dtype=torch.int32, generator=g)
            longest = width * block
            lens = torch.randint(1, longest + 1, (batch,), device="cuda", dtype=torch.int32, generator=g)
            q = torch.randn(heads, batch, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            splits = num_splits_for(batch, kv_heads, sms, longest=int(lens.max()))
            paged_decode_attention(q.transpose(0, 1), k, v, table, lens, block, 0.1, splits,
                                   kv_scales=(scales[layer], scales[layer]))
    assert compiled_variants() == before
