"""The Triton paged decode kernel against the plain-torch reference (run on the H200: -m gpu)."""

from __future__ import annotations

import pytest
import torch

from tandem.service.engine.attention_ref import decode_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "batch, heads, kv_heads, head_dim, block_size, max_len",
    [(1, 32, 8, 128, 16, 4096), (7, 8, 8, 64, 16, 300), (32, 32, 8, 128, 16, 1500),
     (3, 14, 2, 64, 32, 2000), (64, 16, 4, 128, 16, 257), (2, 9, 3, 64, 16, 5000)],
)
def test_kernel_matches_reference(dtype, batch, heads, kv_heads, head_dim, block_size, max_len):
    from tandem.service.engine.triton_decode import num_splits_for, paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(batch * 1000 + max_len)
    num_blocks = batch * (-(-max_len // block_size)) + 8
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    lens = torch.randint(1, max_len + 1, (batch,), device="cuda", generator=g)
    lens[0] = max_len  # the longest context is always exercised, and length 1 too
    if batch > 1:
        lens[1] = 1
    width = -(-max_len // block_size)
    # blocks scattered over the cache in a random order, as after churn
    table = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * width].view(batch, width)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype, generator=g)
    scale = head_dim**-0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for splits in {1, num_splits_for(batch, kv_heads, sms), 32}:
        out = paged_decode_attention(q, k_cache, v_cache, table, lens, block_size, scale, splits)
        pos = torch.arange(width * block_size, device="cuda")
        slots = (table[:, :, None] * block_size + torch.arange(block_size, device="cuda")).view(batch, -1)
        ref = decode_attention(q.float(), k_cache[slots].float(), v_cache[slots].float(),
                               pos[None, :] < lens[:, None], scale)
        tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, f"splits={splits}: relative error {err}"
