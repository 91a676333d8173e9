"""The Triton paged decode kernel against the plain-torch reference (on a GPU: -m gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.service.engine.ops.attention_ref import decode_attention
from tandem.service.engine.ops.decode_grid import ENGINE_CONFIGS, KernelConfig, Splits, num_splits_for
from tandem.service.engine.ops.deferred_rotary import DeferredRotary, rotate

pytestmark = pytest.mark.gpu


SHAPES = [(1, 32, 8, 128, 16, 4096), (7, 8, 8, 64, 16, 300), (32, 32, 8, 128, 16, 1500),
          (3, 14, 2, 64, 32, 2000), (64, 16, 4, 128, 16, 257), (2, 9, 3, 64, 16, 5000),
          (5, 8, 2, 128, 128, 700)]


@pytest.mark.parametrize("store_new", [False, True], ids=["cache-only", "writes-new-kv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, block_size, max_len", SHAPES)
def test_kernel_matches_reference(dtype, batch, heads, kv_heads, head_dim, block_size, max_len, store_new):
    """Fresh random inputs, blocks scattered over the cache, every split count and tile the engine
    may pick; with `store_new` the kernel itself writes each sequence's newest K/V into the cache,
    as a decode step does, and must leave the cache exactly as the reference copy would."""
    _check_kernel(dtype, batch, heads, kv_heads, head_dim, block_size, max_len, store_new, "NHD")


@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, block_size, max_len", SHAPES)
def test_kernel_matches_reference_on_head_major_cache(batch, heads, kv_heads, head_dim, block_size, max_len):
    """The same over an HND cache: [slots, Hkv, D] views of [Hkv, slots, D] storage."""
    _check_kernel(torch.bfloat16, batch, heads, kv_heads, head_dim, block_size, max_len, True, "HND")


@pytest.mark.parametrize("scaling", [1.0, 1.25])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, block_size, max_len", SHAPES)
def test_kernel_rotates_query_and_new_key(
    dtype, batch, heads, kv_heads, head_dim, block_size, max_len, scaling
):
    """Q and the new K handed over unrotated: the kernel rotates them at each sequence's position
    (context length - 1) as transformers would (the reference rotates them with its arithmetic)."""
    base = 500000.0 if head_dim == 128 else 10000.0
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    rotary = DeferredRotary(inv_freq, scaling)
    _check_kernel(dtype, batch, heads, kv_heads, head_dim, block_size, max_len, True, "NHD", rotary)


def _check_kernel(
    dtype, batch, heads, kv_heads, head_dim, block_size, max_len, store_new, layout, rotary=None
):
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(batch * 1000 + max_len)
    num_blocks = batch * (-(-max_len // block_size)) + 8
    slots = num_blocks * block_size
    def cache() -> torch.Tensor:  # [slots, Hkv, D] over either storage
        if layout == "NHD":
            return torch.randn(slots, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
        return torch.randn(kv_heads, slots, head_dim, device="cuda", dtype=dtype, generator=g).transpose(0, 1)

    k_cache, v_cache = cache(), cache()
    lens = torch.randint(1, max_len + 1, (batch,), device="cuda", generator=g)
    lens[0] = max_len  # the longest context is always exercised, and length 1 too
    if batch > 1:
        lens[1] = 1
    width = -(-max_len // block_size)
    # blocks scattered over the cache in a random order, as after churn
    table = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * width].view(batch, width)
    # [B, H, D] view of [H, B, D]: strided as the compiled model hands it over (no copy is made)
    q = torch.randn(heads, batch, head_dim, device="cuda", dtype=dtype, generator=g).transpose(0, 1)
    scale = head_dim**-0.5
    new_kv = None
    ref_k, ref_v = k_cache, v_cache
    ref_q = rotate(lens - 1, rotary, q)[0] if rotary is not None else q
    if store_new:  # [B, Hkv, D] views of [Hkv, B, D], strided as the model hands them over
        new_shape = (kv_heads, batch, head_dim)
        new_k = torch.randn(new_shape, device="cuda", dtype=dtype, generator=g).transpose(0, 1)
        new_v = torch.randn(new_shape, device="cuda", dtype=dtype, generator=g).transpose(0, 1)
        last = lens - 1
        slots = table[torch.arange(batch, device="cuda"), last // block_size].long() * block_size
        slots += last % block_size
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        ref_k.index_copy_(0, slots, rotate(last, rotary, new_k)[0] if rotary is not None else new_k)
        ref_v.index_copy_(0, slots, new_v)
        new_kv = (new_k, new_v, slots)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pos = torch.arange(width * block_size, device="cuda")
    slots_of = (table[:, :, None] * block_size + torch.arange(block_size, device="cuda")).view(batch, -1)
    ref = decode_attention(ref_q.float(), ref_k[slots_of].float(), ref_v[slots_of].float(),
                           pos[None, :] < lens[:, None], scale)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    # one count for all, and counts that follow each sequence's context (random lengths here)
    step_sized = num_splits_for(batch, kv_heads, sms, longest=max_len)  # a mixed step's grid
    table_sized = num_splits_for(batch, kv_heads, sms, longest=width * block_size)  # a captured step's
    # every configuration the engine picks, and (bf16) a tile smaller than a block (tiles that
    # split blocks), a merge in one warp per program, merges of several heads per program (fewer
    # than a sequence's or not dividing them), the step's own token after the loop, and a
    # one-split sequence's output written by its program, the merge skipping it (the sweeps':
    # bench/kernels/profile_gpu.py)
    extra = {KernelConfig(tile=16), KernelConfig(merge_warps=1), KernelConfig(merge_heads=4),
             KernelConfig(merge_heads=32, merge_warps=2),
             KernelConfig(tile=64, stages=2, new_after_loop=True),
             KernelConfig(tile=32, stages=3, new_after_loop=True),
             KernelConfig(tile=64, single_split_direct=True),
             KernelConfig(tile=64, stages=2, new_after_loop=True, single_split_direct=True, merge_heads=4)}
    configs = {*ENGINE_CONFIGS} | (extra if dtype == torch.bfloat16 else set())
    # and a split of other than the engine's tokens (the grid sweep's: bench/kernels/profile_gpu.py)
    for splits in {1, step_sized, table_sized, 32, Splits(1, 32), Splits(2, 5), Splits(2, 64, tokens=256)}:
        for config in configs:
            k_run, v_run = k_cache.clone(), v_cache.clone()  # clone keeps the layout's strides
            assert k_run.stride() == k_cache.stride()
            args = (q, k_run, v_run, table, lens, block_size, scale, splits)
            _poison_free_memory((batch, heads, head_dim), dtype)
            out = paged_decode_attention(*args, new_kv, rotary, config=config)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < tol, f"splits={splits}, {config}: relative error {err}"
            assert torch.equal(v_run, ref_v), f"splits={splits}, {config}"
            if rotary is None:
                assert torch.equal(k_run, ref_k), f"splits={splits}, {config}"
            else:  # the kernel rounds once (fp32 math), transformers' arithmetic after each op
                torch.testing.assert_close(k_run, ref_k, atol=tol, rtol=tol)
    # a sequence that needs one split, in a grid of many: the merge gives it the one-split grid's bits
    wide = Splits(1, 32)
    outs = [paged_decode_attention(q, k_cache.clone(), v_cache.clone(), table, lens, block_size, scale,
                                   splits, new_kv, rotary) for splits in (1, wide)]
    alone = torch.tensor([wide.of(int(n)) == 1 for n in lens], device="cuda")  # batch > 1: length 1
    assert torch.equal(outs[0][alone], outs[1][alone])
    assert alone.any() or batch == 1


def _poison_free_memory(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Leave NaN in the memory the next output of `shape` is likely to get (the caching allocator
    hands back the block freed last), so an element no program writes fails the check instead of
    reading an earlier run's answer."""
    torch.full(shape, float("nan"), dtype=dtype, device="cuda")


WRITE_SHAPES = [(2048, 32, 8, 128), (37, 14, 2, 64), (5, 9, 3, 64), (300, 8, 8, 128), (1, 4, 1, 128)]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("rotary", [False, True], ids=["store-only", "rotates"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", WRITE_SHAPES)
def test_write_kernel_stores_the_steps_kv_and_rotates(
    tokens, heads, kv_heads, head_dim, dtype, rotary, layout
):
    """A step with prompts writes its new K/V with one kernel: every token's K (rotated at its
    position where the model leaves the rotary to the op) and V land in its slot and nowhere else,
    and the queries come back rotated and packed [T, H, D] (or untouched, without rotary). Q/K/V
    are handed over as the compiled model does: strided slices of the fused projection's output."""
    _check_write_kernel(tokens, heads, kv_heads, head_dim, dtype, rotary, layout)


def _check_write_kernel(tokens, heads, kv_heads, head_dim, dtype, rotary, layout):
    from tandem.service.engine.ops.triton_kv_write import write_step_kv

    g = torch.Generator(device="cuda").manual_seed(tokens * 7 + heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype, generator=g)
    q, k, v = (part.view(tokens, -1, head_dim) for part in
               qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    slots = 4 * tokens + 64
    def cache() -> torch.Tensor:  # [slots, Hkv, D] over either storage
        if layout == "NHD":
            return torch.randn(slots, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
        return torch.randn(kv_heads, slots, head_dim, device="cuda", dtype=dtype, generator=g).transpose(0, 1)

    k_cache, v_cache = cache(), cache()
    slot_mapping = torch.randperm(slots, device="cuda", generator=g)[:tokens]  # scattered, as after churn
    positions = torch.randint(0, 40000, (tokens,), device="cuda", generator=g)
    spec = None
    ref_q, ref_k = q, k
    if rotary:
        inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
        spec = DeferredRotary(inv_freq, 1.25)
        ref_q, ref_k = rotate(positions, spec, q, k)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_k_cache.index_copy_(0, slot_mapping, ref_k)
    ref_v_cache.index_copy_(0, slot_mapping, v)
    assert write_step_kv(q, k, v, k_cache.clone(), v_cache.clone(), slot_mapping, positions, spec)[1] is None
    out, keys = write_step_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, spec, keys=True)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert torch.equal(v_cache, ref_v_cache)
    if rotary:  # the kernel rounds once (fp32 math), transformers' arithmetic after each op
        assert out.shape == (tokens, heads, head_dim) and out.is_contiguous()
        torch.testing.assert_close(out, ref_q, atol=tol, rtol=tol)
        torch.testing.assert_close(k_cache, ref_k_cache, atol=tol, rtol=tol)
        assert torch.equal(keys, k_cache[slot_mapping])  # the keys handed back are those stored
        untouched = torch.ones(slots, dtype=torch.bool, device="cuda")
        untouched[slot_mapping] = False
        assert torch.equal(k_cache[untouched], ref_k_cache[untouched])
    else:
        assert out is q and keys is k
        assert torch.equal(k_cache, ref_k_cache)


def test_a_mixed_step_compiles_no_kernel_after_start_up():
    """`compile_step_variants` (run as the engine starts) compiles every variant a mixed step's
    decode rows launch: afterwards, any number of rows at any contexts (split counts from 1 to 32,
    either tile) compiles nothing more, so no step waits for Triton while serving."""
    from tandem.service.engine.ops.triton_decode import compile_step_variants, paged_decode_attention
    from tandem.service.engine.ops.triton_variants import compiled_variants

    g = torch.Generator(device="cuda").manual_seed(3)
    kv_heads, heads, head_dim, block, width = 8, 32, 128, 16, 256  # tables as wide as 4,096 tokens
    k, v = (torch.randn(2 * width * block, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=g) for _ in "kv")
    compile_step_variants(k, v, block, heads, width, torch.bfloat16)

    before = compiled_variants()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch in (1, 5, 9, 32, 63, 64, 130, 256):
        table = torch.randint(0, 2 * width, (batch, width), device="cuda", dtype=torch.int32, generator=g)
        for longest in (1, 700, width * block):
            lens = torch.randint(1, longest + 1, (batch,), device="cuda", dtype=torch.int32, generator=g)
            # the mixed op's query: rows picked from [H, T, D], then [B, H, D]
            q = torch.randn(heads, batch, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            splits = num_splits_for(batch, kv_heads, sms, longest=int(lens.max()))
            paged_decode_attention(q.transpose(0, 1), k, v, table, lens, block, 0.1, splits)
    assert compiled_variants() == before


def test_kernel_addresses_blocks_past_two_billion_elements():
    """A cache of more than 2**31 elements (4 GiB per cache in bf16) switches the kernel to 64-bit
    address arithmetic: blocks at its far end are read and written where they lie."""
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(7)
    kv_heads, head_dim, block_size, batch, width = 8, 128, 16, 4, 8
    num_blocks = 2**31 // (block_size * kv_heads * head_dim) + 64
    k_cache = torch.empty(num_blocks * block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    table = (num_blocks - 1 - torch.randperm(batch * width, device="cuda", generator=g)).view(batch, width)
    slots_of = (table[:, :, None] * block_size + torch.arange(block_size, device="cuda")).view(batch, -1)
    for cache in (k_cache, v_cache):  # only the blocks in use hold data
        cache[slots_of.flatten()] = torch.randn(slots_of.numel(), kv_heads, head_dim, device="cuda",
                                                dtype=cache.dtype, generator=g)
    lens = torch.tensor([width * block_size, 1, 77, 100], device="cuda")
    q = torch.randn(batch, 32, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    new_k, new_v = (torch.randn(batch, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in "kv")
    last = lens - 1
    new_slots = table[torch.arange(batch, device="cuda"), last // block_size] * block_size + last % block_size
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, block_size, head_dim**-0.5, 2,
                                 (new_k, new_v, new_slots))
    assert torch.equal(k_cache[new_slots], new_k) and torch.equal(v_cache[new_slots], new_v)
    pos = torch.arange(width * block_size, device="cuda")
    ref = decode_attention(q.float(), k_cache[slots_of].float(), v_cache[slots_of].float(),
                           pos[None, :] < lens[:, None], head_dim**-0.5)
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1.6e-2


@pytest.mark.parametrize("new_after_loop", [False, True])
def test_kernel_resources_equal_the_launched_kernels(new_after_loop):
    """`tandem bench kernel-resources` compiles the split kernel for sm_90 with no device at hand: for
    the configuration a 64-row decode step launches (one split, its own K/V written and rotated) its
    registers and shared memory equal those of the kernel launched here."""
    from tandem.service.engine.ops import triton_decode
    from tandem.service.engine.ops.decode_grid import kernel_config

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the report compiles for sm_90 (H100, H200)")
    from tandem.bench.kernels.kernel_resources import LAUNCHES, compiled

    g = torch.Generator(device="cuda").manual_seed(3)
    batch, heads, kv_heads, head_dim, block, width = 64, 32, 8, 128, 16, 8
    k, v = (torch.randn(batch * width * block, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=g) for _ in "kv")
    table = torch.randperm(batch * width, device="cuda", dtype=torch.int32, generator=g).view(batch, width)
    lens = torch.full((batch,), width * block, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    new_k, new_v = (torch.randn(batch, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in "kv")
    slots = table[:, -1].long() * block + block - 1
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    config = dataclasses.replace(kernel_config(batch), new_after_loop=new_after_loop)
    new_kv, rotary = (new_k, new_v, slots), DeferredRotary(inv_freq, 1.0)
    triton_decode.paged_decode_attention(q, k, v, table, lens, block, head_dim**-0.5, 1, new_kv, rotary,
                                         config=config)
    kernel = triton_decode._decode_split_kernel
    wanted = {"TILE": config.tile, "DIRECT": True, "STORE_NEW": True, "ROTARY": True,
              "NEW_AFTER_LOOP": new_after_loop,
              "SINGLE_SPLIT_DIRECT": config.single_split_direct}
    launched = [c for cache, *_ in kernel.device_caches.values() for c in cache.values()
                if all(c.src.constants[(kernel.arg_names.index(n),)] == value for n, value in wanted.items())
                and (c.metadata.num_warps, c.metadata.num_stages) == (config.warps, config.stages)]
    assert launched
    c = launched[-1]
    c.run  # noqa: B018  (loads the binary: its registers are read then)
    report = compiled(config, LAUNCHES["decode step, one split"], 90)
    assert (report.registers, report.shared) == (c.n_regs, c.metadata.shared)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, max_len",
                         [(64, 32, 8, 128, 700), (5, 14, 2, 64, 300)])
def test_decode_anatomy_whole_loop_parts_attend_as_the_engine(layout, batch, heads, kv_heads, head_dim,
                                                              max_len):
    """The profile's anatomy kernel (bench/kernels/decode_anatomy.py): its whole-loop parts, in every
    tile and warp count it times, give the engine kernel's attention at one split in bf16, so the times
    it reports are of the same work; and its read part adds up each context's K and V."""
    from tandem.bench.kernels.decode_anatomy import WHOLE_LOOP, parts, run_part
    from tandem.service.engine.ops.triton_decode import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(batch)
    block = 16
    width = -(-max_len // block)
    slots = batch * width * block
    shape = (slots, kv_heads, head_dim) if layout == "NHD" else (kv_heads, slots, head_dim)
    k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    if layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    table = torch.randperm(batch * width, device="cuda", dtype=torch.int32, generator=g).view(batch, width)
    lens = torch.randint(1, max_len + 1, (batch,), device="cuda", dtype=torch.int32, generator=g)
    lens[0] = max_len
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    one = Splits(1, 1)
    ref = paged_decode_attention(q, k, v, table, lens, block, head_dim**-0.5, one).float()
    for part in (p for p in parts() if p.mode in WHOLE_LOOP):
        out = run_part(part, q, k, v, table, lens, block, head_dim**-0.5, one)[:, :, 0]
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err < 1.6e-2, f"{part}: relative error {err}"
    slots_of = (table[:, :, None].long() * block + torch.arange(block, device="cuda")).view(batch, -1)
    live = (torch.arange(width * block, device="cuda")[None, :] < lens[:, None])[:, :, None, None]
    sums = ((k[slots_of].float() + v[slots_of].float()) * live).sum(1).repeat_interleave(heads // kv_heads, 1)
    read = run_part(parts()[0], q, k, v, table, lens, block, 1.0, one)[:, :, 0]
    torch.testing.assert_close(read, sums, atol=0.5, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (4, 2, 64), (14, 2, 64), (8, 8, 128)])
def test_flash_varlen_matches_reference(dtype, heads, kv_heads, head_dim):
    """The packed prompt path's kernel (PyTorch's FlashAttention-2, variable length) against one
    SDPA per chunk in fp32: fresh chunks (queries = the whole context) and continued ones (queries
    = the last positions of a longer context), grouped-query heads read as they are."""
    from tandem.service.engine.ops.attention_ref import varlen_causal_attention
    from tandem.service.engine.ops.varlen_prefill import flash_varlen, varlen_supported

    assert varlen_supported(torch.device("cuda"), dtype, heads, kv_heads, head_dim)
    torch.manual_seed(heads * head_dim)
    chunks = [(128, 128), (7, 7), (1, 1), (33, 300), (64, 65), (200, 1000), (1, 517)]  # (queries, context)
    cu_q = torch.tensor([0] + [q for q, _ in chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    cu_k = torch.tensor([0] + [k for _, k in chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    q = torch.randn(int(cu_q[-1]), heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    scale = head_dim**-0.5
    out = flash_varlen(q, k, v, cu_q, cu_k, max(c for c, _ in chunks), max(c for _, c in chunks), scale)
    ref = varlen_causal_attention(q.float(), k.float(), v.float(), cu_q, cu_k, scale)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for i, (q0, q1) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:], strict=False)):
        err = ((out[q0:q1].float() - ref[q0:q1]).abs().max() / ref[q0:q1].abs().max()).item()
        assert err < tol, f"chunk {i} {chunks[i]}: relative error {err}"
