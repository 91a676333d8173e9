"""The engine's configuration: one record, passed whole from the factory to the runner.

Each field keeps one name from the server's setting (settings.py) down to the code that reads it.
The fields whose names differ hold something the factory resolves from settings: `num_blocks` (from
`num_kv_blocks` or the memory budgets), `kv_offload_blocks` (from `kv_offload_gib`), and
`compile_decode` / `compile_prefill` (from `compile` and `compile_prefill`, on CUDA only).

What a config leaves to the device and the model, `core_builder.resolve` settles once, before the
core is built, for every caller (the server's factory, the benchmarks, the tests): `step_loop`
("auto"), `max_model_len`, `compile_scope` (a model without decoder layers compiles whole), and the
device paths `in_place_decode`, `varlen_prefill` and `cuda_graphs`, each kept on only where the
device and the model can run it. The runner and the core read the resolved values.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's, capped by what the cache holds
    cuda_graphs: bool = True  # decode steps replay captured graphs (needs in_place_decode)
    step_loop: str = "auto"  # "sync" | "async" | "auto" (async on CUDA, sync on CPU)
    # Q/K/V and gate/up as one GEMM each (changes the model in place). The server turns it on for
    # CUDA, where it is faster (docs/benchmarks.md); on the CPU it is not
    fuse_projections: bool = False
    # "NHD" (each token's heads together) or "HND" (each head's tokens together): kv_cache.py
    kv_cache_layout: str = "NHD"
    # "fp8": every linear layer but lm_head in FP8 (W8A8, fp8_linear.py), quantized when the core is
    # built where the model still has them in its own dtype; None: as the model is
    quantization: str | None = None
    # "auto" (the model's dtype) or "fp8" (e4m3 K/V with a scale per layer: kv_cache.py)
    kv_cache_dtype: str = "auto"
    compile_decode: bool = False  # decode-only steps run a torch.compile'd forward
    compile_backend: str = "inductor"  # tests use "aot_eager": same tracing, no code generation
    # what the compiled forwards cover (compile_scope.py): "model", the whole model, or "layer", one
    # decoder layer compiled once and run by every layer (resolve keeps "model" for a model without
    # decoder layers)
    compile_scope: str = "model"
    # CUDA: the library PyTorch's GEMMs prefer ("default" = PyTorch's own pick, "cublas", "cublaslt");
    # a process-wide choice (torch.backends.cuda.preferred_blas_library), made when the core is built
    blas_library: str = "default"
    # the attention ops apply the rotary embedding to Q and K as they load them, instead of the
    # model's element-wise kernels (deferred_rotary.py; where the model allows). The server turns it
    # on for CUDA (docs/benchmarks.md); on the CPU the ops' eager rotation shows no gain
    # (docs/architecture.md)
    fold_rotary: bool = False
    # prefill and mixed steps run a torch.compile'd forward too (symbolic token count, one graph
    # around the mixed attention op), compiled at start-up by a short warm-up. The server turns it on for CUDA
    compile_prefill: bool = False
    telemetry_window_s: float = 60.0  # the sliding window of the engine's idle fraction
    # full KV blocks stay cached for later requests with the same prefix (block_manager.py); the
    # server turns it on (TANDEM_PREFIX_CACHING)
    prefix_caching: bool = False
    # blocks of the host pool that preempted sequences' K/V are copied to (kv_offload.py; pinned on
    # CUDA); 0 = none, preempted sequences are recomputed. The server sizes it (TANDEM_KV_OFFLOAD_GIB)
    kv_offload_blocks: int = 0
    # CUDA: decodes read K/V in place with the Triton kernel (triton_decode.py), where the block
    # size, the head size and the model (no sliding window) allow
    in_place_decode: bool = True
    # CUDA: a step's prompt chunks in one flash-attention call (varlen_prefill.py), where this
    # PyTorch, the device, the dtype and the model (no sliding window) allow
    varlen_prefill: bool = True
    # set by core_builder.resolve only: the fields above are what this device and model run, not
    # what was asked (the runner and the core refuse a config that was not resolved)
    resolved: bool = False
