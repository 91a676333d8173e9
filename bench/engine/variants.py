"""The engine benchmarks' models and engine variants: a random-initialised Llama of a shape, and the
named settings each Tandem variant runs over a benchmark's own spec."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.bench.common import SHAPES

# the server's CUDA defaults over the benchmark's spec: compiled decode and prefill forwards, fused
# projections, cuBLASLt preferred for the GEMMs, the rotary embedding in the attention ops
SERVER_CUDA = {
    "compile_decode": True, "fuse_projections": True, "blas_library": "cublaslt", "fold_rotary": True,
    "compile_prefill": True,
}
# Tandem variants: name -> engine settings over the benchmark's spec (sync loop, CUDA graphs)
VARIANTS = {
    "sync": {},
    "async": {"step_loop": "async"},
    "eager": {"cuda_graphs": False},
    "compiled": {**SERVER_CUDA, "step_loop": "async"},  # what the server runs on CUDA
    "compiled_sync": SERVER_CUDA,
    "compiled_unfused": {**SERVER_CUDA, "step_loop": "async", "fuse_projections": False},
    # over a head-major (HND) KV cache: each head's cache blocks contiguous
    "compiled_hnd": {**SERVER_CUDA, "step_loop": "async", "kv_cache_layout": "HND"},
    # with PyTorch's own pick of GEMM library (cuBLAS) instead of cuBLASLt
    "compiled_cublas": {**SERVER_CUDA, "step_loop": "async", "blas_library": "default"},
    # with the rotary embedding left in the model code (element-wise kernels of the model per layer)
    "compiled_rotary_unfolded": {**SERVER_CUDA, "step_loop": "async", "fold_rotary": False},
    # with prefill and mixed steps run by the model eagerly (the decode steps compiled as above)
    "compiled_eager_prefill": {**SERVER_CUDA, "step_loop": "async", "compile_prefill": False},
    # with one decoder layer compiled and run by every layer instead of the whole model (compile_scope.py)
    "compiled_layer": {**SERVER_CUDA, "step_loop": "async", "compile_scope": "layer"},
}


def build_model(shape: str, device: torch.device, dtype: torch.dtype, vocab: int | None = None
                ) -> LlamaForCausalLM:
    """A random-initialised Llama of `shape` (seed 0: the same weights every time); `vocab`: its
    vocabulary size instead of the shape's."""
    config = LlamaConfig(**{**SHAPES[shape], **({"vocab_size": vocab} if vocab else {})},
                         max_position_embeddings=32768)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()
