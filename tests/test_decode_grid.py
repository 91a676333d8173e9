"""The decode kernel's grid and launch rules (decode_grid.py): plain Python, checked on any host;
the kernel itself runs them on a GPU (test_gpu_kernels.py)."""

from __future__ import annotations

from tandem.service.engine.ops.decode_grid import (
    MAX_SPLITS,
    SPLIT_TOKENS,
    engine_configs,
    kernel_config,
    least_splits,
    num_splits_for,
)


def test_grid_holds_every_split_of_the_longest_context():
    """The grid holds every split the longest context takes (one per SPLIT_TOKENS), even at batch
    sizes large enough to fill the device alone; capped at about 64 programs per multiprocessor,
    and never under the device-covering least."""
    sms, kv_heads = 132, 8
    assert num_splits_for(210, kv_heads, sms, longest=2000).most == -(-2000 // SPLIT_TOKENS)
    assert num_splits_for(210, kv_heads, sms, longest=16384).most == 64 * sms // (210 * kv_heads)
    assert num_splits_for(210, kv_heads, sms, longest=100).most == 1  # nothing to split
    for batch in (1, 8, 64, 256):
        least = least_splits(batch, kv_heads, sms)
        assert batch * kv_heads * least >= min(2 * sms, batch * kv_heads * MAX_SPLITS)
        for longest in (100, 4096, 16384):
            grid = num_splits_for(batch, kv_heads, sms, longest)
            assert grid.least == least
            assert batch * kv_heads * grid.most <= max(64 * sms, batch * kv_heads * least)
            cap = max(least, min(MAX_SPLITS, 64 * sms // (batch * kv_heads)))
            for n in range(1, longest + 1, 7):  # each context: one split per SPLIT_TOKENS, to the cap
                assert grid.of(n) == max(least, min(-(-n // SPLIT_TOKENS), cap))


def test_every_configuration_the_engine_picks_is_among_those_tested():
    """`kernel_config` picks only from `engine_configs` (each of which test_gpu_kernels.py's
    `_check_kernel` and test_gpu_fp8_kv.py run): one pipeline stage from 9 to 63 sequences, two
    elsewhere; over an e4m3 cache one stage below 64 sequences, but a decode step's (its own K/V
    stored) two stages and float16 products at every size; the step's own token after the loop
    everywhere."""
    for kv_fp8 in (False, True):
        for store_new in (False, True):
            picks = {kernel_config(batch, kv_fp8, store_new) for batch in range(1, 513)}
            assert picks == set(engine_configs(kv_fp8, store_new))
            assert {config.f16_products for config in picks} == {kv_fp8 and store_new}
            assert all(config.new_after_loop for config in picks)
    assert {kernel_config(batch).stages for batch in (9, 32, 63)} == {1}
    assert {kernel_config(batch).stages for batch in (1, 8, 64, 256)} == {2}
    assert {kernel_config(batch, True, store_new=False).stages for batch in (1, 8, 9, 63)} == {1}
    assert {kernel_config(batch, True, store_new=False).stages for batch in (64, 256)} == {2}
    assert {kernel_config(batch, kv_fp8=True).stages for batch in (1, 8, 32, 256)} == {2}
