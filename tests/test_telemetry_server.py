"""Telemetry of a real `tandem serve` process: OTLP spans, OTLP metrics, Prometheus /metrics, dashboard.

One server (tiny random llama) serves the module. It exports to an OTLP/gRPC receiver running in
this process, built from opentelemetry-proto's service definitions. Before any test runs, the
fixture scrapes /metrics once with no load, then drives a few seconds of real load and scrapes
again, so the idle-fraction and cost checks see only that load inside the server's window.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_samples import Samples, grown, scrape, scrape_when, value, value_or_zero
from serverproc import ServerFactory

# KServe requests are built from tritonclient's stubs: other modules of the suite import tritonclient,
# whose `inference.*` protos clash with tandem.kserve's in one process
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from tandem.service.telemetry.metrics import TIME_PER_OUTPUT_TOKEN_BUCKETS, TIME_TO_FIRST_TOKEN_BUCKETS
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

MODEL = "tiny-llama"
WINDOW_S = 6.0  # the server's idle / cost window
PRICE, GPUS = 2.5, 2
LOAD_S = 2.5  # clients keep the engine busy this long
CHART = Path(__file__).resolve().parent.parent / "charts" / "tandem"
DASHBOARD = CHART / "dashboards" / "tandem.json"


# -- the OTLP receiver ---------------------------------------------------------------------------


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.cond = threading.Condition()

    def Export(self, request, context):
        with self.cond:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
            self.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout: float = 30.0) -> list[Span]:
        """Spans matching `predicate`, once at least one has arrived."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [s for s in self.spans if predicate(s)]
                if found or time.monotonic() > deadline:
                    return found
                self.cond.wait(0.2)


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.names: set[str] = set()
        self.service_names: set[str] = set()

    def Export(self, request, context):
        for rm in request.resource_metrics:
            for kv in rm.resource.attributes:
                if kv.key == "service.name":
                    self.service_names.add(kv.value.string_value)
            for sm in rm.scope_metrics:
                self.names.update(m.name for m in sm.metrics)
        return metrics_service_pb2.ExportMetricsServiceResponse()


# -- helpers -------------------------------------------------------------------------------------


def attrs(span: Span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
        )
    return out


@dataclass
class Load:
    completion_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    multi_token_requests: int = 0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, prompt: int, completion: int) -> None:
        with self.lock:
            self.requests += 1
            self.prompt_tokens += prompt
            self.completion_tokens += completion
            self.multi_token_requests += completion > 1


def drive_load(address: str, until: float, worker: int, load: Load) -> None:
    """Back-to-back requests until `until`: streams on even workers, unary calls on odd ones."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TandemStub(channel)
        i = 0
        while time.monotonic() < until:
            req = pb.GenerateRequest(
                text=f"Request {worker}.{i}: the quick brown fox jumps over the lazy dog " * 3,
                stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True),
            )
            if worker % 2 == 0:
                received, usage = 0, None
                for r in stub.GenerateStream(req, timeout=60):
                    received += len(r.token_ids)
                    usage = r.usage if r.HasField("usage") else usage
                assert usage is not None and usage.completion_tokens == received
            else:
                r = stub.Generate(req, timeout=60)
                received, usage = len(r.token_ids), r.usage
            load.add(usage.prompt_tokens, received)
            i += 1


@dataclass
class Served:
    address: str
    metrics_url: str
    traces: TraceReceiver
    otlp_metrics: MetricsReceiver
    quiet: dict[str, list]  # /metrics before any request
    during: dict[str, list]  # /metrics in the middle of the load
    after: dict[str, list]  # /metrics right after the load
    load: Load
    scraped_after_load_start_s: float  # how long after the load began the `after` scrape was taken
    http_url: str  # the OpenAI HTTP API


TOKENS = "tandem_generation_tokens_total"


def recorded(samples: Samples, quiet: Samples, load: Load) -> bool:
    """Whether the server's metrics count all of `load`: its tokens (the engine's reports) and its
    requests (the fronts' records)."""
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    labels = {"gen_ai_request_model": MODEL, "gen_ai_operation_name": "text_completion"}
    return (grown(quiet, samples, TOKENS) >= load.completion_tokens
            and value_or_zero(samples, ttft, **labels) >= load.requests)  # none before the load


@pytest.fixture(scope="module")
def served(serve: ServerFactory) -> Iterator[Served]:
    traces, otlp_metrics = TraceReceiver(), MetricsReceiver()
    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(traces, receiver)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(otlp_metrics, receiver)
    otlp_port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    try:
        with serve.started(  # stopped before the receiver: its last exports still find one
            "--model-name", MODEL,
            "--num-kv-blocks", "256",
            "--kv-offload-gib", "0.01",  # a host pool of 1,310 blocks of this model's K/V
            "--otlp-endpoint", f"http://127.0.0.1:{otlp_port}",
            "--step-trace-sample-rate", "1",
            "--telemetry-window-s", str(WINDOW_S),
            "--price-per-gpu-hour", str(PRICE),
            "--num-gpus", str(GPUS),
            metrics=True,
            http=True,
            # export quickly instead of every 5 s (spans) / 60 s (metrics)
            env={"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "500"},
        ) as live:  # fmt: skip
            address, url, http_url = live.address, live.metrics_url, live.http_url
            quiet = scrape(url)
            load = Load()
            started = time.monotonic()
            workers = [
                threading.Thread(target=drive_load, args=(address, started + LOAD_S, w, load))
                for w in range(4)
            ]
            for w in workers:
                w.start()
            time.sleep(LOAD_S / 2)
            # the supervisor records the engine's reports a moment after they are made: the first
            # scrape from mid-load on that shows the load, taken before the load ends
            during = scrape_when(url, lambda s: value_or_zero(s, "tandem_requests_running") >= 1,
                                 timeout_s=max(0.0, started + LOAD_S - time.monotonic()))
            for w in workers:
                w.join()
            after = scrape_when(url, lambda s: recorded(s, quiet, load))
            elapsed = time.monotonic() - started
            load.seconds = elapsed
            yield Served(address, url, traces, otlp_metrics, quiet, during, after, load, elapsed, http_url)
    finally:
        receiver.stop(grace=None)


# -- /metrics ------------------------------------------------------------------------------------


def test_healthz_and_unknown_paths(served: Served):
    base = served.metrics_url.removesuffix("/metrics")
    with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
        assert r.status == 200 and r.read() == b"ok\n"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/nothing", timeout=10)
    assert err.value.code == 404


def test_token_counters_match_what_the_clients_received(served: Served):
    load = served.load
    assert load.requests >= 4 and load.completion_tokens > 0
    generated = value(served.after, "tandem_generation_tokens_total") - value(
        served.quiet, "tandem_generation_tokens_total"
    )
    prompt = value(served.after, "tandem_prompt_tokens_total") - value(
        served.quiet, "tandem_prompt_tokens_total"
    )
    assert generated == load.completion_tokens
    assert prompt == load.prompt_tokens


def test_idle_fraction_is_one_without_load_and_falls_under_load(served: Served):
    quiet = value(served.quiet, "tandem_gpu_idle_fraction")
    loaded = value(served.after, "tandem_gpu_idle_fraction")
    assert quiet > 0.97  # only the warm-up's few steps lie in the window
    # the engine was busy for most of LOAD_S seconds of a WINDOW_S-second window
    assert loaded < 0.8 and loaded < quiet - 0.2, (quiet, loaded)


def test_cost_per_million_tokens_is_price_over_throughput(served: Served):
    assert served.scraped_after_load_start_s < WINDOW_S - 0.5, "the load outlasted the window; rerun"
    # every token of the load lies in the window (and no other): throughput = tokens / window
    tokens_per_hour = served.load.completion_tokens * 3600 / WINDOW_S
    expected = PRICE * GPUS / tokens_per_hour * 1e6
    assert math.isclose(value(served.after, "tandem_cost_per_million_tokens_usd"), expected, rel_tol=1e-9)
    # GPUs paid for, nothing made: infinitely expensive, which OpenTelemetry cannot carry: no sample
    assert "tandem_cost_per_million_tokens_usd" not in served.quiet


def test_model_info_says_what_the_pod_serves_and_the_operator_still_reads_the_pod(served: Served):
    """tandem_model_info: one series of value 1 whose labels tell an FP8 pod from a bf16 one (here the
    defaults: no quantization, the KV cache in the CPU model's float32); the operator's scrape of the same
    /metrics finds every metric it needs."""
    from tandem.operator.scrape import parse_metrics, problem_of

    ((labels, one),) = served.after["tandem_model_info"]
    assert one == 1.0
    assert labels.items() >= {"model": MODEL, "quantization": "none", "kv_cache_dtype": "float32"}.items()
    with urllib.request.urlopen(served.metrics_url, timeout=10) as r:
        sample = parse_metrics("pod-0", time.time(), r.read().decode())
    assert problem_of(sample) is None and sample.generated_tokens


def test_start_up_phases_and_the_time_to_serving(served: Served):
    """tandem_startup_seconds: every phase the engine's start-up went through (on the CPU the compile
    and the graph capture take next to nothing), none more than the time from the process's start
    to SERVING, which they add up to at most."""
    from tandem.service.telemetry.startup import PHASES

    deadline = time.monotonic() + 10  # the supervisor records SERVING as the fronts turn to it
    while "tandem_startup_serving_seconds" not in (scraped := scrape(served.metrics_url)):
        assert time.monotonic() < deadline, "no tandem_startup_serving_seconds"
        time.sleep(0.1)
    phases = {labels["phase"]: seconds for labels, seconds in scraped["tandem_startup_seconds"]}
    serving = value(scraped, "tandem_startup_serving_seconds")
    assert set(phases) == set(PHASES)
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["spawn"] > 0.1 and phases["weights"] > 0 and phases["warm_up"] > 0  # imports take time
    assert sum(phases.values()) <= serving + 0.05 < 300, (phases, serving)


def test_capacity_is_fitted_from_the_steps_and_utilization_is_the_share_used(served: Served):
    """The spare-capacity signal: what the pod could generate at its traffic's mix, and how much of
    it the window's tokens used (all of the load's tokens lie in the window)."""
    capacity = value(served.after, "tandem_capacity_tokens_per_second")
    utilization = value(served.after, "tandem_capacity_utilization")
    achieved = served.load.completion_tokens / WINDOW_S
    # four clients keep at most four sequences running; the pod holds 256 (max_num_seqs, KV cache)
    assert capacity > 2 * achieved > 0
    assert 0 < utilization < 0.5
    assert math.isclose(utilization * capacity, achieved, rel_tol=1e-6)


def test_prefix_cache_counters_count_the_prompts_and_what_was_found_cached(served: Served):
    """Every admitted prompt token is looked up; the load's prompts differ in their first block,
    so none is found. Then the same long prompt twice: the second finds all its full blocks but
    the one holding its last token (16 tokens a block)."""
    queries, hits = "tandem_prefix_cache_queries_total", "tandem_prefix_cache_hits_total"
    assert value(served.quiet, queries) == 0  # the warm-up is not traffic
    assert value(served.after, queries) == served.load.prompt_tokens
    assert value(served.after, hits) == 0
    before = scrape(served.metrics_url)
    traces = ["5a1c0d1e00000000000000000000cafe", "5a1c0d1e00000000000000000000beef"]
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.TandemStub(channel)
        req = pb.GenerateRequest(
            text="You are a careful assistant. Answer briefly and cite the manual. " * 6,
            stopping=pb.StoppingCriteria(max_tokens=2, ignore_eos=True),
        )
        usages = [
            stub.Generate(req, timeout=60, metadata=[("traceparent", f"00-{t}-{CALLER_SPAN}-01")]).usage
            for t in traces
        ]
    after = scrape(served.metrics_url)
    prompt = usages[0].prompt_tokens
    assert value(after, queries) - value(before, queries) == 2 * prompt
    hit = (prompt - 1) // 16 * 16
    assert value(after, hits) - value(before, hits) == hit > 0
    # each request's own share: in its usage and on its span (GenAI's cache-read attribute)
    assert [u.cached_prompt_tokens for u in usages] == [0, hit]
    for trace_id, found in zip(traces, (0, hit), strict=True):
        def root(span: Span, trace_id: str = trace_id) -> bool:
            return span.trace_id.hex() == trace_id and span.name == f"generate {MODEL}"

        assert attrs(served.traces.wait_for(root)[0])["gen_ai.usage.cache_read.input_tokens"] == found


def test_preempted_requests_go_to_the_host_pool_and_keep_their_tokens(served: Served):
    """More live context than the KV cache holds (256 blocks x 16 tokens; twelve requests of 400 +
    150, the first 64 prompt tokens the same): some are preempted, their K/V copied to the host pool
    and back, or found still cached on the device, the shared prefix's blocks left there (counted by
    direction), and every request gets the greedy tokens it gets alone. The prompts alone fill the
    cache (4 + 12 x 21 blocks), so the requests overflow it even when a loaded host hands them to the
    engine some steps apart."""
    rng = random.Random(11)
    shared = [rng.randrange(1, 500) for _ in range(64)]
    prompts = [shared + [rng.randrange(1, 500) for _ in range(336)] for _ in range(12)]
    new_tokens = 150
    before = scrape(served.metrics_url)
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.TandemStub(channel)

        def generate(prompt: list[int]) -> list[int]:
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                stopping=pb.StoppingCriteria(max_tokens=new_tokens, ignore_eos=True),
            )
            return list(stub.Generate(req, timeout=120).token_ids)

        alone = [generate(p) for p in prompts]
        # a host too loaded to hand the engine the twelve close together can serve a round without
        # running out of blocks: then another round, each checked (a few at most)
        for rounds in range(1, 4):
            with futures.ThreadPoolExecutor(len(prompts)) as pool:
                assert list(pool.map(generate, prompts)) == alone
            generated = (1 + rounds) * len(prompts) * new_tokens
            after = scrape_when(served.metrics_url, lambda s, n=generated: grown(before, s, TOKENS) >= n)
            if grown(before, after, "tandem_preemptions_total", mode="offload") > 0:
                break

    def delta(name: str, **labels: str) -> float:
        return grown(before, after, name, **labels)

    assert delta("tandem_preemptions_total", mode="offload") > 0
    assert delta("tandem_preemptions_total", mode="recompute") == 0  # the pool had room for all
    back = delta("tandem_kv_offload_blocks_total", direction="in")
    reused = delta("tandem_kv_offload_blocks_total", direction="reused")
    assert back + reused == delta("tandem_kv_offload_blocks_total", direction="out") > 0
    assert delta("tandem_kv_offload_blocks_total", direction="kept") > 0  # the prefix others held
    assert value(after, "tandem_kv_offload_usage_ratio") == 0  # every request finished


def test_engine_gauges_under_load(served: Served):
    assert value(served.quiet, "tandem_requests_running") == 0
    assert value(served.during, "tandem_requests_running") >= 1
    assert value(served.during, "tandem_kv_cache_usage_ratio") > 0
    assert value(served.after, "tandem_requests_waiting") == 0
    assert value(served.after, "tandem_kv_cache_usage_ratio") == 0  # every request finished


def test_cache_config_info_gives_the_kv_caches_shape(served: Served):
    """tandem_cache_config_info: one series of value 1 labelled with the block size the server runs
    (the default 16 tokens) and the blocks it was given (--num-kv-blocks 256), from the first report on."""
    for samples in (served.quiet, served.after):
        ((labels, one),) = samples["tandem_cache_config_info"]
        assert one == 1.0
        assert labels.items() >= {"block_size": "16", "num_gpu_blocks": "256"}.items()


def test_the_engine_serves_with_its_start_up_heap_frozen_and_counts_its_collections(served: Served):
    """The engine process froze its start-up objects (model, torch, transformers) out of the garbage
    collector's walks before serving, and reports each collection it made since, by generation."""
    assert value(served.quiet, "tandem_engine_gc_frozen_objects") > 50_000
    collections, pause = "tandem_engine_gc_collections_total", "tandem_engine_gc_pause_seconds_total"
    # the load's steps and requests made garbage: young collections ran, and took time
    assert value(served.after, collections, generation="0") > value(served.quiet, collections, generation="0")
    assert value(served.after, pause, generation="0") > value(served.quiet, pause, generation="0")
    for generation in "012":
        assert value(served.after, collections, generation=generation) >= 0


def test_latency_histograms_use_the_genai_buckets(served: Served):
    load, after, quiet = served.load, served.after, served.quiet
    ttft = "gen_ai_server_time_to_first_token_seconds"
    tpot = "gen_ai_server_time_per_output_token_seconds"
    duration = "gen_ai_server_request_duration_seconds"
    labels = {"gen_ai_request_model": MODEL, "gen_ai_operation_name": "text_completion"}
    assert value(after, f"{ttft}_count", **labels) == load.requests
    assert value(after, f"{tpot}_count", **labels) == load.multi_token_requests
    assert value(after, f"{duration}_count", **labels) == load.requests
    assert f"{ttft}_count" not in quiet  # the warm-up is not traffic
    bounds = sorted(float(lab["le"]) for lab, _ in after[f"{ttft}_bucket"])
    assert bounds == [*TIME_TO_FIRST_TOKEN_BUCKETS, math.inf]
    bounds = sorted(float(lab["le"]) for lab, _ in after[f"{tpot}_bucket"])
    assert bounds == [*TIME_PER_OUTPUT_TOKEN_BUCKETS, math.inf]
    # a request's TTFT is shorter than its duration; their sums say the same
    assert 0 < value(after, f"{ttft}_sum", **labels) < value(after, f"{duration}_sum", **labels)


def test_step_durations_by_stage(served: Served):
    for stage in ("prepare", "compute", "step"):
        assert value(served.after, "tandem_step_duration_seconds_count", stage=stage) > 0
    assert "h2d" not in {lab["stage"] for lab, _ in served.after["tandem_step_duration_seconds_count"]}


def test_metrics_also_go_out_over_otlp(served: Served):
    deadline = time.monotonic() + 20
    wanted = {"tandem_generation_tokens", "tandem_gpu_idle_fraction", "gen_ai.server.time_to_first_token"}
    while not wanted <= served.otlp_metrics.names and time.monotonic() < deadline:
        time.sleep(0.2)
    assert wanted <= served.otlp_metrics.names
    assert served.otlp_metrics.service_names == {"tandem"}


# -- spans ---------------------------------------------------------------------------------------

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def _children(traces: TraceReceiver, parent: Span) -> dict[str, Span]:
    kids = traces.wait_for(lambda s: s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id)
    return {s.name: s for s in kids}


def _check_request_tree(traces: TraceReceiver, trace_id: str) -> tuple[Span, dict[str, Span]]:
    found = traces.wait_for(lambda s: s.trace_id.hex() == trace_id and s.name == f"generate {MODEL}")
    assert len(found) == 1
    root = found[0]
    assert root.kind == Span.SPAN_KIND_SERVER
    assert root.parent_span_id.hex() == CALLER_SPAN  # the caller's context, from `traceparent`
    kids = _children(traces, root)
    assert set(kids) == {"queue", "prefill", "decode"}
    q, p, d = kids["queue"], kids["prefill"], kids["decode"]
    # one after the other, inside the request
    assert root.start_time_unix_nano <= q.start_time_unix_nano <= q.end_time_unix_nano
    assert q.end_time_unix_nano == p.start_time_unix_nano <= p.end_time_unix_nano
    assert p.end_time_unix_nano == d.start_time_unix_nano <= d.end_time_unix_nano <= root.end_time_unix_nano
    return root, kids


def test_native_generate_span_tree_and_attributes(served: Served):
    traceparent = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
    req = pb.GenerateRequest(
        text="Once upon a time",
        sampling=pb.SamplingParams(temperature=0.7, seed=3),
        stopping=pb.StoppingCriteria(max_tokens=12, ignore_eos=True),
        request_id="traced-1",
    )
    with grpc.insecure_channel(served.address) as channel:
        responses = list(
            pb_grpc.TandemStub(channel).GenerateStream(
                req, metadata=[("traceparent", traceparent)], timeout=60
            )
        )
    received = sum(len(r.token_ids) for r in responses)
    root, _ = _check_request_tree(served.traces, TRACE_ID)
    a = attrs(root)
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.response.id"] == "traced-1"
    assert a["gen_ai.usage.input_tokens"] == responses[-1].usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == received == 12
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.seed"] == 3
    assert a["tandem.request.stream"] is True
    assert a["rpc.system"] == "grpc" and a["rpc.method"] == "GenerateStream"


def test_kserve_infer_span_keeps_the_callers_trace(served: Served):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    text = kpb.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"The sky is")  # KServe v2: BYTES in contents
    req = kpb.ModelInferRequest(model_name=MODEL, inputs=[text], id="k-1")
    with grpc.insecure_channel(served.address) as channel:
        kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            req, metadata=[("traceparent", f"00-{trace_id}-{CALLER_SPAN}-01")], timeout=60
        )
    root, _ = _check_request_tree(served.traces, trace_id)
    a = attrs(root)
    assert a["rpc.service"] == "inference.GRPCInferenceService" and a["rpc.method"] == "ModelInfer"
    assert a["gen_ai.response.id"] == "k-1"
    assert a["gen_ai.usage.output_tokens"] > 0


def test_an_http_request_joins_the_callers_trace_and_is_counted_once(served: Served):
    """The OpenAI front's request: one server span under the caller's `traceparent` header, with the
    same children and GenAI attributes as gRPC's, and one count in each latency histogram."""
    trace_id = "33333333333333333333333333333333"
    labels = {"gen_ai_request_model": MODEL, "gen_ai_operation_name": "chat"}
    names = [f"gen_ai_server_{h}_count" for h in ("request_duration_seconds", "time_to_first_token_seconds")]

    def counts() -> list[float]:
        samples = scrape(served.metrics_url)
        return [sum(v for lab, v in samples.get(n, []) if labels.items() <= lab.items()) for n in names]

    before = counts()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 7,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    req = urllib.request.Request(
        served.http_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.read().endswith(b"data: [DONE]\n\n")
    root, _ = _check_request_tree(served.traces, trace_id)
    a = attrs(root)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.response.model"] == MODEL
    assert a["http.request.method"] == "POST" and a["http.route"] == "/v1/chat/completions"
    assert "rpc.system" not in a
    assert a["gen_ai.response.id"].startswith("chatcmpl-")
    assert a["gen_ai.usage.output_tokens"] == 7 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["tandem.request.stream"] is True
    deadline = time.monotonic() + 10  # the front's record reaches the supervisor's /metrics soon after
    while counts() != [b + 1 for b in before] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    assert counts() == [b + 1 for b in before]


def test_a_rejected_request_is_an_error_span(served: Served):
    trace_id = "11111111111111111111111111111111"
    req = pb.GenerateRequest(text="hi", model="no-such-model")
    with grpc.insecure_channel(served.address) as channel, pytest.raises(grpc.RpcError):
        pb_grpc.TandemStub(channel).Generate(
            req, metadata=[("traceparent", f"00-{trace_id}-{CALLER_SPAN}-01")], timeout=60
        )
    [root] = served.traces.wait_for(lambda s: s.trace_id.hex() == trace_id)
    assert root.status.code == root.status.STATUS_CODE_ERROR
    assert attrs(root)["error.type"] == "NOT_FOUND"


def test_engine_steps_are_traced_with_their_stages(served: Served):
    steps = served.traces.wait_for(lambda s: s.name == "step")
    assert steps
    step = steps[-1]
    assert step.parent_span_id == b""  # a step is its own trace: it serves many requests
    a = attrs(step)
    assert a["tandem.step.batch_size"] >= 1 and a["tandem.step.num_tokens"] >= a["tandem.step.batch_size"]
    kids = _children(served.traces, step)
    assert set(kids) == {"prepare", "compute"}  # no separate h2d / d2h on CPU
    assert kids["prepare"].end_time_unix_nano == kids["compute"].start_time_unix_nano
    assert step.start_time_unix_nano == kids["prepare"].start_time_unix_nano
    assert step.end_time_unix_nano == kids["compute"].end_time_unix_nano


# -- the Grafana dashboard -----------------------------------------------------------------------


def test_dashboard_queries_only_metrics_the_server_exports(served: Served):
    import re

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    names = set()
    for expr in exprs:
        names |= set(re.findall(r"\b((?:tandem|gen_ai)_[a-z_]+)\b", expr))
    names = {n for n in names if not n.startswith("tandem_operator_")}  # the operator's: test_dashboard.py
    exported = set(served.after)
    missing = {n for n in names if n not in exported}
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
    for wanted in (
        "tandem_gpu_idle_fraction",
        "tandem_cost_per_million_tokens_usd",
        "tandem_requests_waiting",
    ):
        assert wanted in names


# -- the Inference Gateway's endpoint picker --------------------------------------------------------


def test_the_inference_gateways_picker_reads_gauges_the_server_exports(served: Served):
    """The endpoint picker the chart deploys (inferenceGateway on) is told, for each metric of the
    Inference Extension's model server protocol, a selector that finds in this server's /metrics a
    gauge with the protocol's meaning, read as the picker reads it: the plain-text exposition it gets
    without an Accept header, the family of that name, a sample whose labels match."""
    import helm_python as helm
    from inference_gateway import engine_metrics, parse_spec, picker_config
    from prometheus_client.parser import text_string_to_metric_families

    with helm.Chart.load(CHART) as chart:
        out = chart.render({"inferenceGateway": {"enabled": True}}, name="tandem", namespace="tandem")
    docs = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    specs = engine_metrics(picker_config(docs, "smollm2", "tandem"))
    assert specs["loraSpec"] == ""  # no LoRA adapters: the picker reads none

    with urllib.request.urlopen(served.metrics_url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}

    def gauge(field: str) -> tuple[str, dict[str, str]]:
        name, labels = parse_spec(specs[field])
        assert families[name].type == "gauge", (field, families[name].type)
        samples = [s for s in families[name].samples if labels.items() <= s.labels.items()]
        assert len(samples) == 1, (field, samples)
        return name, samples[0].labels

    # queued and running requests: the engine's waiting queue and running batch (none once idle, the
    # batch during the load); KV-cache utilisation a fraction 0-1 (the picker scores 1 - it)
    running, waiting = gauge("runningRequestsSpec")[0], gauge("queuedRequestsSpec")[0]
    kv = gauge("kvUsageSpec")[0]
    assert value(served.during, running) >= 1 and value(served.after, running) == 0
    assert value(served.after, waiting) == 0
    assert 0 < value(served.during, kv) <= 1 and value(served.after, kv) == 0
    # the KV cache's shape in the label names the picker reads by default
    _, labels = gauge("cacheInfoSpec")
    assert (int(labels["block_size"]), int(labels["num_gpu_blocks"])) == (16, 256)


def test_a_cancelled_stream_ends_its_span_as_cancelled(served: Served):
    trace_id = "22222222222222222222222222222222"
    req = pb.GenerateRequest(
        text="Tell me a long story", stopping=pb.StoppingCriteria(max_tokens=400, ignore_eos=True)
    )
    with grpc.insecure_channel(served.address) as channel:
        call = pb_grpc.TandemStub(channel).GenerateStream(
            req, metadata=[("traceparent", f"00-{trace_id}-{CALLER_SPAN}-01")], timeout=60
        )
        next(call)
        next(call)
        call.cancel()  # the client goes away mid-stream
    [root] = served.traces.wait_for(lambda s: s.trace_id.hex() == trace_id and s.name == f"generate {MODEL}")
    a = attrs(root)
    assert a["error.type"] == "cancelled"
    assert 2 <= a["gen_ai.usage.output_tokens"] < 400
    assert "gen_ai.response.finish_reasons" not in a
    assert {"queue", "prefill", "decode"} == set(_children(served.traces, root))
