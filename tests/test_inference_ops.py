"""The engine's ops that write the KV cache dispatch straight to their kernels: autograd's version
bump (a Python kernel per call that torch.library.custom_op adds for a mutated argument) is skipped,
since the engine runs inference only (ops/inference_ops.py)."""

from __future__ import annotations

import pytest
import torch
from engine_harness import Arrival, hf_greedy, make_core, run
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.service.contract import SamplingParams
from tandem.service.engine.ops import inference_ops
from tandem.service.engine.ops.inference_ops import without_version_bumps


@pytest.mark.parametrize("op", ["tandem::paged_mixed", "tandem::paged_decode"])
def test_the_ops_that_write_the_cache_dispatch_past_the_version_bump(op):
    import tandem.service.engine.ops.decode_op  # noqa: F401  (registers the ops)
    import tandem.service.engine.ops.mixed_op  # noqa: F401

    assert torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(op, "ADInplaceOrView")
    assert op in inference_ops.SKIPPED


def test_steps_with_prompts_and_decode_steps_keep_generates_tokens():
    """Both ops run (a prompt, then decode steps) and give transformers' generate()'s tokens."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    core = make_core(model, num_blocks=32, block_size=4)
    prompt = [5, 17, 42, 8, 99, 3, 250]
    result = run(core, [Arrival("r", prompt, SamplingParams(max_tokens=5))])
    assert result.tokens["r"] == hf_greedy(model, prompt, 5, None)


def test_only_the_engines_own_ops_are_changed():
    with pytest.raises(ValueError, match="only the engine's own ops"):
        without_version_bumps("aten::index_copy_")


def test_a_pytorch_that_refuses_the_override_keeps_custom_ops_kernel(monkeypatch):
    """Before Library.impl took allow_override, overriding a kernel registered from Python raised:
    the op then keeps its version bump and the engine still imports."""
    class Refusing:  # and no dispatcher handle to fall back on
        def impl(self, *args, **kwargs):
            raise RuntimeError("This is not allowed since there's already a kernel registered from python")

    monkeypatch.setattr(inference_ops, "_LIBRARY", Refusing())
    monkeypatch.setattr(inference_ops, "SKIPPED", [])
    assert without_version_bumps("tandem::paged_mixed") is False
    assert inference_ops.SKIPPED == []


def test_a_pytorch_whose_library_refuses_the_override_still_gets_the_fall_through():
    """PyTorch 2.11 (the GPU images') raises in Library.impl when custom_op registered the key from
    Python: the fall-through then goes in through the library's dispatcher handle."""
    import tandem.service.engine.ops.mixed_op  # noqa: F401  (registers the op)

    op = "tandem::paged_mixed"

    class RefusingLibrary(torch.library.Library):
        def impl(self, *args, **kwargs):
            raise RuntimeError("This is not allowed since there's already a kernel registered from python")

    engine_library = inference_ops._LIBRARY
    engine_library._destroy()  # custom_op's own kernel back, as on a PyTorch that refused at import
    try:
        assert not torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(op, "ADInplaceOrView")
        inference_ops._LIBRARY = RefusingLibrary("tandem", "FRAGMENT")
        assert without_version_bumps(op) is True
        assert torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(op, "ADInplaceOrView")
        inference_ops._LIBRARY._destroy()
    finally:  # the engine's own registrations, for the tests after this one
        inference_ops._LIBRARY = torch.library.Library("tandem", "FRAGMENT")
        for name in list(inference_ops.SKIPPED):
            without_version_bumps(name)
    assert torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(op, "ADInplaceOrView")
