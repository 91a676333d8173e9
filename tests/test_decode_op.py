"""Which caches and models the decode op hands to the Triton kernel (the rest take the gathered path)."""

from __future__ import annotations

import pytest

from tandem.service.engine.ops.decode_op import kernel_supports


@pytest.mark.parametrize("head_dim", [64, 128, 256, 16])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_the_kernel_takes_power_of_two_blocks_and_heads_of_16_or_more(block_size, head_dim):
    assert kernel_supports(block_size, head_dim)


@pytest.mark.parametrize(
    ("block_size", "head_dim"),
    [
        (8, 128),  # blocks under the kernel's least tile
        (24, 128),  # not a power of two
        (16, 8),  # heads under its matrix products' least size
        (16, 80),  # heads of models such as Phi-2 and Phi-3 (80, 96): Triton's ranges need powers of two
        (16, 96),
    ],
)
def test_other_blocks_and_heads_take_the_gathered_path(block_size, head_dim):
    assert not kernel_supports(block_size, head_dim)
