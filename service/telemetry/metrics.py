"""The server's instruments (DESIGN.md section 4), one set for Prometheus and OTLP alike.

Instrument names are chosen so that the Prometheus exporter produces exactly the documented
names: counters gain `_total`, a unit of seconds gains `_seconds`, a unit in braces adds nothing,
dots become underscores (`gen_ai.server.time_to_first_token` -> `..._seconds_bucket` etc.).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from ..contract import EngineStats, GcTotals, RequestRecord
from .cost import TokenWindow, cost_per_million_tokens

# Bucket boundaries of the OpenTelemetry GenAI semantic conventions (gen-ai-metrics)
REQUEST_DURATION_BUCKETS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
# Engine steps: from a CUDA-graph decode of a small model to a long prefill chunk
STEP_DURATION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self, meter: Meter, tokens: TokenWindow, price_per_gpu_hour: float, num_gpus: int) -> None:
        self.tokens = tokens
        self.price_per_gpu_hour = price_per_gpu_hour
        self.num_gpus = num_gpus
        # what the gauges read when collected: the engine's latest report (None before the first)
        self.engine_stats: Callable[[], EngineStats | None] = lambda: None
        self.engine_gc: Callable[[], GcTotals | None] = lambda: None  # the engine process's collections
        # (capacity in generated tokens/s, the share the traffic uses); None until the fit can say
        self.capacity: Callable[[], tuple[float, float] | None] = lambda: None
        # the labels of tandem_model_info; None until the engine has loaded the model
        self.model_info: Callable[[], dict[str, str] | None] = lambda: None
        # (tokens per KV-cache block, blocks of the device's KV cache); None before the engine's first report
        self.cache_config: Callable[[], tuple[int, int] | None] = lambda: None
        # (seconds of each start-up phase, seconds from the process's start to SERVING or None)
        self.startup: Callable[[], tuple[dict[str, float], float | None]] = lambda: ({}, None)
        self._info_gauges(meter)
        self._startup_gauges(meter)
        self._request_instruments(meter)
        self._engine_gauges(meter)
        self._gc_instruments(meter)
        self._capacity_gauges(meter)

    def _request_instruments(self, meter: Meter) -> None:
        """What the front records per request and the engine per step: tokens, latencies, step times."""
        self.generation_tokens = meter.create_counter(
            "tandem_generation_tokens",
            unit="{token}",
            description="Tokens the engine generated for requests.",
        )
        self.prompt_tokens = meter.create_counter(
            "tandem_prompt_tokens",
            unit="{token}",
            description="Prompt tokens of requests that were prefilled.",
        )
        for counter in (self.generation_tokens, self.prompt_tokens):
            counter.add(0)  # exported from the start: rate() needs the zero before the first request
        self.time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=list(TIME_TO_FIRST_TOKEN_BUCKETS),
        )
        self.time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token generated after the first token for successful responses.",
            explicit_bucket_boundaries_advisory=list(TIME_PER_OUTPUT_TOKEN_BUCKETS),
        )
        self.request_duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration: receipt to last output token.",
            explicit_bucket_boundaries_advisory=list(REQUEST_DURATION_BUCKETS),
        )
        self.step_duration = meter.create_histogram(
            "tandem_step_duration_seconds",
            unit="s",
            description="Engine step time by stage (prepare, h2d, compute, d2h; step = the whole step).",
            explicit_bucket_boundaries_advisory=list(STEP_DURATION_BUCKETS),
        )

    def _engine_gauges(self, meter: Meter) -> None:
        """The engine's latest report: its batch, queue, caches, preemptions and host pool."""
        self._gauge(
            meter, "tandem_requests_running", "{request}", "Requests in the running batch.", "running"
        )
        self._gauge(
            meter, "tandem_requests_waiting", "{request}", "Requests queued for admission.", "waiting"
        )
        self._gauge(meter, "tandem_kv_cache_usage_ratio", "1", "Share of KV-cache blocks in use.", "kv_usage")
        self._gauge(
            meter,
            "tandem_gpu_idle_fraction",
            "",
            "Share of the telemetry window with no engine step in flight (1 = idle).",
            "idle_fraction",
        )
        for name, field, what in (
            ("tandem_prefix_cache_queries", "prefix_cache_queried_tokens", "looked up in the prefix cache"),
            ("tandem_prefix_cache_hits", "prefix_cache_hit_tokens", "found cached (not prefilled)"),
        ):
            meter.create_observable_counter(
                name,
                callbacks=[self._observer(field)],
                unit="{token}",
                description=f"Prompt tokens {what}, since start.",
            )
        meter.create_observable_counter(
            "tandem_preemptions",
            callbacks=[
                self._by_label("mode", preemptions_offload="offload", preemptions_recompute="recompute")
            ],
            unit="{request}",
            description="Requests preempted because the KV cache ran out, since start, by what became of "
            "their K/V: offload = copied to the host pool and back, recompute = dropped and recomputed.",
        )
        meter.create_observable_counter(
            "tandem_kv_offload_blocks",
            callbacks=[
                self._by_label(
                    "direction",
                    kv_offload_blocks_out="out",
                    kv_offload_blocks_in="in",
                    kv_offload_blocks_reused="reused",
                    kv_offload_blocks_kept="kept",
                )
            ],
            unit="{block}",
            description="KV-cache blocks copied to the host pool (out) and back (in), since start; reused: "
            "blocks not copied back because the prefix cache still held them on the device; kept: blocks "
            "of preempted requests not copied out because a running request shared them.",
        )
        self._gauge(
            meter,
            "tandem_kv_offload_usage_ratio",
            "1",
            "Share of the host pool of preempted requests' K/V in use (0 without a pool).",
            "kv_offload_usage",
        )

    def _gc_instruments(self, meter: Meter) -> None:
        """The engine process's garbage collections and what its start-up froze out of them."""
        for name, field, unit, what in (
            ("tandem_engine_gc_collections", "collections", "{collection}",
             "Python garbage collections in the engine process"),
            ("tandem_engine_gc_pause", "seconds", "s",
             "Time the engine process's step loop stood still in Python garbage collections"),
        ):  # fmt: skip
            meter.create_observable_counter(
                name,
                callbacks=[self._gc_observer(field)],
                unit=unit,
                description=f"{what} since it began serving, by generation (2 = a full collection).",
            )
        meter.create_observable_gauge(
            "tandem_engine_gc_frozen_objects",
            callbacks=[self._observe_frozen],
            unit="{object}",
            description="Objects of the engine's start-up (model, compiled code, graphs) frozen out of the "
            "garbage collector's walks.",
        )

    def _capacity_gauges(self, meter: Meter) -> None:
        """What the autoscaler reads: the pod's capacity, the share of it in use, the cost per token."""
        meter.create_observable_gauge(
            "tandem_capacity_tokens_per_second",
            callbacks=[lambda _: self._observe_capacity(0)],
            unit="{token}/s",
            description="Generated tokens per second this pod could make at the current traffic's mix, "
            "fitted from its own step times (absent until it has seen enough steps).",
        )
        meter.create_observable_gauge(
            "tandem_capacity_utilization",
            callbacks=[lambda _: self._observe_capacity(1)],
            unit="1",
            description="Generated tokens per second over the window / tandem_capacity_tokens_per_second: "
            "the share of the pod's capacity its traffic uses (1 - spare capacity).",
        )
        meter.create_observable_gauge(
            "tandem_cost_per_million_tokens_usd",
            callbacks=[self._observe_cost],
            unit="{USD}",
            description="Price per GPU-hour x GPUs / generated tokens per hour, x 1e6, over the window "
            "(absent while no token was generated in the window).",
        )

    def _info_gauges(self, meter: Meter) -> None:
        # What the pod serves as labels of one constant series (Prometheus' info pattern, as
        # kube_pod_info): dashboards join it to any other metric by pod, e.g. cost per token by
        # quantization, and the other series keep their label sets (the operator sums over them)
        meter.create_observable_gauge(
            "tandem_model_info",
            callbacks=[self._observe_model_info],
            unit="",
            description="1, labelled with what the pod's engine built (absent until it has loaded the "
            "model): model, quantization (fp8: FP8 linear layers, from the setting or the checkpoint; "
            "none) and kv_cache_dtype (fp8, or the model's dtype by name).",
        )
        # The KV cache's shape in the labels vLLM and SGLang give theirs (`vllm:cache_config_info`): the
        # Gateway API Inference Extension's endpoint picker reads them to size its prefix-cache index
        meter.create_observable_gauge(
            "tandem_cache_config_info",
            callbacks=[self._observe_cache_config],
            unit="",
            description="1, labelled with the KV cache's shape (absent until the engine's first report): "
            "block_size (tokens per block) and num_gpu_blocks (blocks of the KV cache on the device).",
        )

    def _startup_gauges(self, meter: Meter) -> None:
        meter.create_observable_gauge(
            "tandem_startup_seconds",
            callbacks=[self._observe_startup_phases],
            unit="s",
            description="Seconds the server's start-up spent in each phase (absent until the engine is "
            "ready): spawn (the process's start, imports, the engine process's spawn), weights, kv_cache "
            "(the engine assembled), compile (each step shape's first run), graph_capture, warm_up.",
        )
        meter.create_observable_gauge(
            "tandem_startup_serving_seconds",
            callbacks=[self._observe_serving_after],
            unit="s",
            description="Seconds from the server process's start to SERVING: the engine ready and every "
            "front too (absent before).",
        )

    def _observe_startup_phases(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(seconds, {"phase": phase}) for phase, seconds in self.startup()[0].items()]

    def _observe_serving_after(self, _: CallbackOptions) -> Iterable[Observation]:
        serving_after = self.startup()[1]
        return [] if serving_after is None else [Observation(serving_after)]

    def _observe_cache_config(self, _: CallbackOptions) -> Iterable[Observation]:
        shape = self.cache_config()
        if shape is None:
            return []
        return [Observation(1, {"block_size": str(shape[0]), "num_gpu_blocks": str(shape[1])})]

    def _observe_model_info(self, _: CallbackOptions) -> Iterable[Observation]:
        labels = self.model_info()
        return [] if labels is None else [Observation(1, labels)]

    def _observer(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """A callback reading one field of the engine's latest report (nothing before the first)."""

        def observe(_: CallbackOptions) -> Iterable[Observation]:
            stats = self.engine_stats()
            return [] if stats is None else [Observation(getattr(stats, field))]

        return observe

    def _by_label(self, label: str, **fields: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """A callback reading several fields of the engine's latest report, one value of `label` each."""

        def observe(_: CallbackOptions) -> Iterable[Observation]:
            stats = self.engine_stats()
            if stats is None:
                return []
            return [Observation(getattr(stats, f), {label: value}) for f, value in fields.items()]

        return observe

    def _gc_observer(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """A callback reading one per-generation field of the engine process's collections."""

        def observe(_: CallbackOptions) -> Iterable[Observation]:
            totals = self.engine_gc()
            if totals is None:
                return []
            return [Observation(n, {"generation": str(g)}) for g, n in enumerate(getattr(totals, field))]

        return observe

    def _observe_frozen(self, _: CallbackOptions) -> Iterable[Observation]:
        totals = self.engine_gc()
        return [] if totals is None else [Observation(totals.frozen_objects)]

    def _gauge(self, meter: Meter, name: str, unit: str, description: str, field: str) -> None:
        observe = self._observer(field)
        meter.create_observable_gauge(name, callbacks=[observe], unit=unit, description=description)

    def record_request(self, record: RequestRecord) -> None:
        """The latency histograms of one finished request, as its front saw it."""
        attrs = {"gen_ai.operation.name": record.operation, "gen_ai.request.model": record.model}
        if record.time_to_first_token is not None:
            self.time_to_first_token.record(record.time_to_first_token, attrs)
        if record.time_per_output_token is not None:
            self.time_per_output_token.record(record.time_per_output_token, attrs)
        self.request_duration.record(
            record.duration, attrs if record.error is None else {**attrs, "error.type": record.error}
        )

    def _observe_capacity(self, field: int) -> Iterable[Observation]:
        capacity = self.capacity()
        return [] if capacity is None else [Observation(capacity[field])]

    def cost_per_million_tokens(self) -> float | None:
        return cost_per_million_tokens(self.price_per_gpu_hour, self.num_gpus, self.tokens.tokens_per_hour())

    def _observe_cost(self, _: CallbackOptions) -> Iterable[Observation]:
        cost = self.cost_per_million_tokens()
        return [] if cost is None else [Observation(cost)]
