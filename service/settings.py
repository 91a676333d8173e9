"""Every server setting: environment variables `TANDEM_<NAME>`, overridden by CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", protected_namespaces=())

    model: str | None = Field(
        None, description="Local transformers model directory or .gguf file; unset = embedded SmolLM2-135M."
    )
    model_name: str | None = Field(
        None, description="Name the model is served under (default: smollm2-135m-instruct / the path's stem)."
    )
    cache_dir: Path | None = Field(
        None,
        description="Where converted GGUF models and (compile_cache) compiled artefacts are kept "
        "(default: $XDG_CACHE_HOME/tandem).",
    )
    prefetch_weights: bool = Field(
        True,
        description="While the engine process imports, ask the kernel to read the model's weight files "
        "into the page cache (posix_fadvise WILLNEED), when they take at most half the memory left to the "
        "process: a node that never read the model loads it from memory after the imports.",
    )
    compile_cache: bool = Field(
        True,
        description="Keep torch.compile's and Triton's artefacts under cache_dir/compile/, so that a "
        "restart, or another pod given the same directory, compiles nothing it compiled before "
        "(docs/operator.md: a shared cache volume). Off: the compiler's temporary directory.",
    )
    host: str = Field("0.0.0.0", description="Address the gRPC and HTTP servers bind.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = pick a free one).")
    tls_cert_file: Path | None = Field(
        None,
        description="PEM certificate chain of the gRPC and HTTP ports; with tls_key_file they speak TLS "
        "only. Both files are read again when they change (a rotated Secret volume), for new connections.",
    )
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_client_ca_file: Path | None = Field(
        None,
        description="PEM CA bundle: set = mutual TLS, every client must present a certificate it signed "
        "(needs tls_cert_file); read again when it changes.",
    )
    auth_token_file: Path | None = Field(
        None,
        description="Bearer tokens accepted, one per line (blank lines and # comments ignored), read again "
        "when the file changes: set = every RPC but grpc.health.v1 needs `authorization: Bearer <token>` "
        "metadata, else UNAUTHENTICATED; on the HTTP port every /v1 request needs the same header, else 401.",
    )
    health_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="A plaintext port serving only grpc.health.v1, on `host` (0 = off): kubelet gRPC probes "
        "cannot speak TLS, so with TLS on they ask here.",
    )
    reflection: bool = Field(True, description="gRPC server reflection (grpcurl, Postman) on the gRPC port.")
    http_port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="Port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models; /health and /ready) on `host`, served by every front process beside gRPC (0 = off).",
    )
    http_access_log: bool = Field(
        False,
        description="A log line per HTTP request (uvicorn's access log); off by default: it costs speed.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV-cache dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="fp8: linear layers in FP8 (W8A8: e4m3 weights with a scale per output channel, "
        "activations quantized per token as they run), a bf16 or GGUF model quantized at load; the "
        "embeddings and lm_head stay in the model's dtype. Unset = as the checkpoint is: an FP8 checkpoint "
        "(compressed-tensors or block-wise FP8) runs in FP8, any other in `dtype` (docs/quantization.md).",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="KV-cache dtype: auto = the model's (`dtype`); fp8 = e4m3 K and V with a scale per "
        "layer, half the bytes per cached token, so the cache holds twice the tokens (docs/quantization.md).",
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="Fixed number of KV blocks; overrides the memory-based sizing below."
    )
    kv_cache_memory_fraction: float = Field(
        0.85,
        gt=0,
        lt=1,
        description="CUDA: share of free device memory (after loading) given to the KV cache.",
    )
    kv_cache_cpu_gib: float = Field(2.0, gt=0, description="CPU: KV-cache size in GiB.")
    kv_offload_gib: float | None = Field(
        None,
        ge=0,
        description="Host memory, in GiB, for the K/V of preempted requests (KV offload): a request "
        "preempted when the KV cache runs out has its blocks copied there and back before it resumes, "
        "instead of being recomputed; when it is full, preempted requests are recomputed. Pinned memory "
        "on CUDA: count it in the pod's memory limit. Unset = 4 on CUDA, 0 (off) on CPU, where the KV "
        "cache is host memory already (make it larger instead).",
    )
    kv_cache_layout: Literal["NHD", "HND"] = Field(
        "NHD",
        description="KV-cache memory layout: NHD stores each token's KV heads together, HND each KV "
        "head's tokens together (contiguous cache blocks per head for the CUDA decode kernel).",
    )
    cuda_graphs: bool = Field(
        True, description="CUDA: decode steps replay CUDA graphs captured at start (per batch-size bucket)."
    )
    compile: bool = Field(
        True,
        description="CUDA: decode steps run a torch.compile'd forward (fused norms, residuals, activations); "
        "adds compile time to start-up (minutes for an 8B model: docs/benchmarks.md).",
    )
    compile_prefill: bool = Field(
        True,
        description="CUDA, with --compile: prefill and mixed steps run a torch.compile'd forward as well "
        "(one graph for every token count, around one attention op), compiled during warm-up "
        "(a longer start-up: docs/benchmarks.md).",
    )
    compile_scope: Literal["model", "layer"] = Field(
        "model",
        description="CUDA, with --compile: what the compiled forwards cover. model: the whole model, "
        "traced layer by layer in every new process; layer: one decoder layer, compiled once and run by "
        "every layer (PyTorch's regional compilation: a shorter compile at start-up, the embedding and "
        "the LM head eager, a compiled call per layer: docs/benchmarks.md).",
    )
    fuse_projections: bool = Field(
        True,
        description="CUDA: Q/K/V and gate/up projections run as one GEMM each (the weights are "
        "concatenated at start-up, in place of the separate ones).",
    )
    fold_rotary: bool = Field(
        True,
        description="CUDA: the attention ops apply the rotary embedding to Q and K as they load them "
        "(the decode kernel, and the kernel that writes a prompt step's K/V), instead of element-wise "
        "kernels of the model per layer (where the model's RoPE type allows it; docs/benchmarks.md).",
    )
    blas_library: Literal["default", "cublas", "cublaslt"] = Field(
        "cublaslt",
        description="CUDA: the library PyTorch's GEMMs prefer (default = PyTorch's own pick, cuBLAS); "
        "cuBLASLt is the faster on the H200's decode steps (docs/benchmarks.md).",
    )
    step_loop: Literal["auto", "sync", "async"] = Field(
        "auto", description="async: prepare step N+1 while the device runs step N; auto = async on CUDA."
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="Threads of the engine's CPU tensor work (torch.set_num_threads); unset = on CPU the "
        "cores left to it beside the front processes (at least 1), on CUDA PyTorch's default.",
    )
    max_num_seqs: int = Field(256, ge=1, description="Most sequences running in one step.")
    prefix_caching: bool = Field(
        True,
        description="Keep the KV blocks of full prompt blocks for later requests that start with the same "
        "tokens (automatic prefix caching): they skip the prefill of that prefix. Cached blocks nobody uses "
        "are evicted, least recently used first, only when no block is free.",
    )
    prefix_cache_isolation: Literal["token", "shared"] = Field(
        "token",
        description="Who shares cached prefixes. token: only requests presenting the same bearer token "
        "(auth_token_file; without it, every request), so one tenant can neither read another's cached "
        "K/V nor time whether a prompt is cached; shared: every request. Either way a request's "
        "`cache_salt` narrows its scope to requests with the same salt.",
    )
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step (decodes + prefill chunks)."
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Context length per request (prompt + output); default: the model's."
    )
    default_max_tokens: int = Field(256, ge=1, description="New tokens when a request does not say.")
    max_waiting_requests: int = Field(
        4096,
        ge=1,
        description="Queue bound, every front's requests together: the newest requests still waiting past "
        "it once a step has admitted what it can get RESOURCE_EXHAUSTED.",
    )
    request_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Longest a generation may take, queue included: past it (or past the client's own "
        "deadline, or KServe's `timeout` parameter, whichever comes first) it ends with DEADLINE_EXCEEDED "
        "and its KV blocks are freed; a request whose deadline passes while it waits never starts. "
        "Unset = only the client's deadline.",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="How the OpenAI chat API reads tool calls out of the model's text: hermes "
        "(`<tool_call>` tags: Qwen2.5/3, Hermes), llama3_json (Llama 3.x JSON objects), "
        "mistral (`[TOOL_CALLS]` and a JSON array, or `[TOOL_CALLS]name[ARGS]{...}`). auto: from the "
        "chat template's markers, else "
        "the architecture; hermes where the template does not render tools (Tandem then writes them "
        "into the prompt in the Hermes format; docs/api.md).",
    )
    max_stop_strings: int = Field(16, ge=0, description="Most stop strings per request.")
    max_stop_string_chars: int = Field(256, ge=1, description="Longest stop string accepted.")
    grammar_cache_size: int = Field(
        256, ge=1,
        description="Structured output: compiled grammars kept in the engine (least recently used "
        "first out); a request whose schema, regex, choices or grammar is cached skips the compile.",
    )
    max_message_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest gRPC message accepted or sent."
    )
    warmup: bool = Field(True, description="Run a short generation before health turns SERVING.")
    api_processes: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto",
        description="Front processes, all on `port` and `http_port` (SO_REUSEPORT) and all feeding the one "
        "engine process (1 to 64). auto: 1 when the engine runs on the CPU; on CUDA one per core the pod "
        "may use (affinity and cgroup CPU quota) beyond 2 kept for the engine, at most 4 "
        "(docs/architecture.md).",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="A stream sends once this many new tokens wait (1 = each token as soon as it can; "
        "tokens that wait while a stream is still sending always go out together).",
    )
    stream_interval_ms: float = Field(
        0.0,
        ge=0,
        description="A stream sends once this many milliseconds have passed since its last message (with "
        "stream_interval: once both hold); the first token and the last are never held back.",
    )
    drain_timeout_s: float = Field(
        60.0, ge=0, description="On SIGTERM: how long running streams may finish before the server stops."
    )
    metrics_port: int = Field(
        9400,
        ge=0,
        le=65535,
        description="HTTP port of Prometheus /metrics and the liveness probe /healthz (0 = off); plaintext "
        "and without authentication: it carries no prompts, no text and no secrets.",
    )
    metrics_host: str | None = Field(
        None, description="Address the /metrics and /healthz server binds (default: `host`)."
    )
    telemetry: bool = Field(
        True,
        description="OpenTelemetry spans (requests, engine steps) and OTLP metrics; exported only when an "
        "OTLP endpoint is configured. Off: neither (/metrics is governed by metrics_port).",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/gRPC collector, e.g. http://otel-collector:4317; unset = the standard "
        "OTEL_EXPORTER_OTLP_(TRACES_|METRICS_)ENDPOINT variables; none of them = no export.",
    )
    step_trace_sample_rate: float = Field(
        0.01,
        ge=0,
        le=1,
        description="Share of engine steps traced as `step` spans (0 = none, 1 = every step).",
    )
    telemetry_window_s: float = Field(
        60.0, gt=0, description="Sliding window, in seconds, of the GPU idle fraction and the cost per token."
    )
    price_per_gpu_hour: float = Field(
        0.0, ge=0, description="USD per GPU-hour, for tandem_cost_per_million_tokens_usd (0 = no cost)."
    )
    num_gpus: int = Field(
        1, ge=0, description="GPUs this server is charged for (cost = price x GPUs / tokens)."
    )

    @model_validator(mode="after")
    def _tls_files_together(self) -> ServerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        return self

    @model_validator(mode="after")
    def _ports_differ(self) -> ServerSettings:
        ports = {"port": self.port, "http_port": self.http_port, "health_port": self.health_port}
        if self.metrics_host in (None, self.host):
            ports["metrics_port"] = self.metrics_port
        taken: dict[int, str] = {}
        for name, port in ports.items():
            if port and port in taken:  # 0 = off (or, for `port`, a free one)
                raise ValueError(f"{name} and {taken[port]} are both {port}: each server needs its own port")
            taken[port] = name
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None
