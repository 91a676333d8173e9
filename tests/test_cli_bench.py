"""`tandem bench gpu --smoke`: the benchmark runs from the CLI and writes its table and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_tandem_bench_gpu_smoke_writes_table_json_and_timeline(tmp_path):
    out, trace, png = tmp_path / "bench.json", tmp_path / "trace.json", tmp_path / "timeline.png"
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(tandem), "bench", "gpu", "--smoke", "--skip-hf", "--out", str(out), "--timeline", str(trace),
         "--trace-overhead"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| tandem |" in proc.stdout and "roofline (decode)" in proc.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "gpu_sync" and result["smoke"] is True
    assert result["tandem"]["tokens"] == result["workload"]["requests"] * result["workload"]["new_tokens"]
    assert result["roofline"]["copy_bandwidth_TBps"] > 0
    # the steady decode's share: mean roofline step over the median measured step
    roof, tandem = result["roofline"], result["tandem"]
    expected = roof["step_ms_mean"] / tandem["step_ms"]["median"]
    assert 0 < tandem["median_step_of_roofline_step"] == pytest.approx(expected, abs=1e-4)
    # the GEMM floor: the workload's GEMMs timed alone plus its K/V reads; shares of it and of it
    floor, new = result["gemm_floor"], result["workload"]["new_tokens"]
    parts = floor["prefill_seconds"] + (new - 1) * floor["decode_gemm_ms_per_step"] / 1e3
    assert floor["decode_gemm_ms_per_step"] > 0 and floor["prefill_steps"] >= 1
    assert floor["seconds"] == pytest.approx(parts + floor["decode_kv_read_seconds"], rel=0.01, abs=2e-4)
    assert floor["of_roofline"] == pytest.approx(roof["seconds"] / floor["seconds"], rel=0.01, abs=1e-4)
    assert tandem["fraction_of_gemm_floor"] == pytest.approx(floor["seconds"] / tandem["seconds"], rel=0.05)
    assert tandem["engine"]["step_loop"] == "sync"  # each engine reports its own settings
    # each timed run: its slowest step beside what could have held it up (garbage collections, compiles)
    for timed in tandem["all_runs"]:
        assert timed["step_ms_max"] > 0 and timed["gc_full_collections"] >= 0 and timed["gc_s"] >= 0
        assert timed["frames_compiled"] == timed["kernel_variants_compiled"] == 0  # warmed up, nothing new
        assert isinstance(timed["slow_step_stacks"], list)
    assert "tandem, timed run 1: slowest step" in proc.stdout
    assert result["imported_server_only_modules"] == []
    overhead = result["tracing_overhead"]
    assert set(overhead) == {"engine", "tracing_off", "steps_traced_1pct", "steps_traced_100pct"}
    # the timeline: every step of the recorded run, its stages in order on the wall clock
    events = json.loads(trace.read_text())["traceEvents"]
    steps = result["timeline"]["tandem_sync"]["steps"]
    compute = sorted((e for e in events if e["tid"] == "compute"), key=lambda e: e["args"]["step"])
    prepare = sorted((e for e in events if e["tid"] == "prepare"), key=lambda e: e["args"]["step"])
    assert len(compute) == len(prepare) == steps > 1
    for p, c in zip(prepare, compute, strict=True):
        assert p["ts"] <= c["ts"] and c["dur"] > 0
    for a, b in zip(compute, compute[1:], strict=False):
        assert a["ts"] + a["dur"] <= b["ts"] + 1  # sync loop on the host clock: steps do not overlap
    draw = subprocess.run(
        [str(Path(sys.executable).with_name("tandem")), "bench", "timeline", str(trace), "--out", str(png),
         "--skip", "1", "--steps", "3"], capture_output=True, text=True, timeout=120,
    )
    assert draw.returncode == 0, draw.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tandem_bench_rejects_unknown_benchmark():
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run([str(tandem), "bench", "nope"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_tandem_bench_gpu_profile_runs_the_profiler_script():
    """`gpu-profile` maps to bench/kernels/profile_gpu.py: its options from the CLI, and on a host without
    CUDA a one-line refusal instead of a traceback."""
    tandem = Path(sys.executable).with_name("tandem")
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    usage = subprocess.run([str(tandem), "bench", "gpu-profile", "--help"], capture_output=True, text=True,
                           timeout=300, env=env)
    assert usage.returncode == 0, usage.stderr[-2000:]
    assert "--attention" in usage.stdout and "--engine" in usage.stdout
    run = subprocess.run([str(tandem), "bench", "gpu-profile", "--no-step"], capture_output=True, text=True,
                         timeout=300, env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 1 and "needs a CUDA device" in run.stderr
    assert "Traceback" not in run.stderr


def test_tandem_bench_kernel_resources_compiles_or_says_what_it_needs(tmp_path):
    """`kernel-resources` maps to bench/kernels/kernel_resources.py: with Triton it compiles the decode
    kernel for sm_90 (no device needed) and reports each configuration; without, one line."""
    tandem = Path(sys.executable).with_name("tandem")
    out = tmp_path / "resources.json"
    run = subprocess.run([str(tandem), "bench", "kernel-resources", "--out", str(out)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert "Traceback" not in run.stderr
    if run.returncode == 0:
        rows = json.loads(out.read_text())["rows"]
        assert {(r["tile"], r["stages"]) for r in rows} >= {(64, 1), (32, 1)}
        assert all(r["registers"] > 0 and r["resident_per_sm"] >= 1 for r in rows)
    else:
        assert run.returncode == 1 and "compiles with Triton" in run.stderr


def test_kernel_resources_compiles_the_decode_kernel_over_an_e4m3_cache():
    """`kernel-resources --kv-cache-dtype fp8`: the kernel over an e4m3 cache, its products on e4m3
    or float16 operands too, and held to fewer registers, compiles for sm_90 without a device."""
    pytest.importorskip("triton")
    from tandem.bench.kernels.kernel_resources import FP8_CONFIGS, LAUNCHES, compiled

    assert {c.products for c in FP8_CONFIGS} == {"-", "P.V", "Q.K^T", "both", "float16"}
    for products in ("both", "float16"):
        config = next(c for c in FP8_CONFIGS if c.products == products and c.stages == 1)
        r = compiled(config, LAUNCHES["decode step, with a merge"], 90, kv_fp8=True)
        assert r.registers > 0 and r.resident() >= 1
    # held to 128 registers a thread, the decode step's kernel keeps four programs resident
    capped = next(c for c in FP8_CONFIGS if c.max_registers)
    r = compiled(capped, LAUNCHES["decode step, with a merge"], 90, kv_fp8=True)
    assert r.registers <= capped.max_registers == 128 and r.resident() == 4


def test_gemm_floor_counts_every_gemm_weight_once():
    """The floor's GEMMs are the engine's: fused projections are one weight of the summed rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.bench.engine.gemm_floor import linear_shapes
    from tandem.service.engine.ops.fused_projections import fuse_projections

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    q, kv, up = (64, 64), (32, 64), (128, 64)
    assert linear_shapes(model) == ({q: 4, kv: 4, up: 4, (64, 128): 2}, (512, 64))
    fuse_projections(model)
    assert linear_shapes(model) == ({(128, 64): 2, (64, 64): 2, (256, 64): 2, (64, 128): 2}, (512, 64))


def test_gemm_floor_times_the_fp8_engines_linears_through_its_fp8_gemm(monkeypatch):
    """An engine whose linear layers run in FP8 gets the FP8 GEMM's floor, not bf16's: every body
    weight shape goes through the FP8 timing, the LM head (kept in the model's dtype) does not."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.bench.engine import gemm_floor
    from tandem.bench.workloads.bounds import fp8_gemm_rate
    from tandem.service.engine.ops.fp8_linear import quantize_linears

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    assert gemm_floor.fp8_shapes(model) == set()
    quantize_linears(model)
    shapes, head = gemm_floor.linear_shapes(model)
    assert gemm_floor.fp8_shapes(model) == set(shapes) and head not in gemm_floor.fp8_shapes(model)
    timed_fp8, timed_dense = [], []
    fp8, dense = gemm_floor.time_fp8_linear, gemm_floor.time_linear
    monkeypatch.setattr(gemm_floor, "time_fp8_linear",
                        lambda rows, o, i, *a, **k: timed_fp8.append((o, i)) or fp8(rows, o, i, *a, **k))
    monkeypatch.setattr(gemm_floor, "time_linear",
                        lambda x, o, i, *a, **k: timed_dense.append((o, i)) or dense(x, o, i, *a, **k))
    assert gemm_floor.forward_gemm_seconds(model, 16, 4) > 0
    assert sorted(timed_fp8) == sorted(shapes) and timed_dense == [head]
    assert fp8_gemm_rate(torch.device("cpu"), torch.float32) > 0


def _held_up_step() -> None:
    time.sleep(0.3)


def test_slow_step_stacks_name_where_a_long_step_waited_and_skip_fast_ones():
    """The sampler sees the main thread only inside a step past its threshold: a 300 ms step is
    found in the function that held it up; fast steps leave nothing."""
    from tandem.bench.engine.slow_steps import SlowStepStacks

    steps = SlowStepStacks(after_s=0.05, every_s=0.005)
    steps.start()
    for _ in range(20):  # fast steps: never sampled
        steps.watched(lambda: time.sleep(0.005))
    time.sleep(0.1)  # between steps: not sampled either
    assert steps.stop() == []
    steps.start()
    steps.watched(_held_up_step)
    seen = steps.stop()
    assert seen and seen[0]["stack"].split(" < ")[0].endswith("_held_up_step")  # sleep: C, no frame
    assert 0.1 <= sum(s["seconds"] for s in seen) <= 0.3


def test_profile_sorts_kernels_by_kind():
    """The GPU profile's grouping: FlashAttention's kernels (their names carry "cutlass") are the
    prefill's attention, not GEMMs."""
    from tandem.bench.kernels.profile_gpu import kernel_kind

    flash = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, cutlass::"
    assert kernel_kind(flash) == "prefill attention (FlashAttention)"
    assert kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "GEMM (cuBLAS)"
    assert kernel_kind("_decode_split_kernel") == "decode attention"
    silu = "triton_poi_fused__unsafe_view_mul_silu_split_with_sizes_2"
    assert kernel_kind(silu) == "fused element-wise (Triton)"


def test_tandem_bench_serve_smoke_loads_the_server_and_the_engine_alone(tmp_path):
    """Both sides run requests of the same lengths, through both fronts of one server: every request
    completes with its tokens, the ratios are theirs. Each pass (the engine alone, gRPC, HTTP) sends
    prompts of its own after a system prompt of its own: the prefix cache holds, for every request,
    its pass's system prompt (warmed by the pass's warm-up) and nothing another pass sent."""
    out = tmp_path / "serve.json"
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(tandem), "bench", "serve", "--smoke", "--front", "grpc,http", "--shared-prefix", "32",
         "--out", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 4 streams |" in proc.stdout and "| 20.0 req/s |" in proc.stdout
    assert "| 4 streams, HTTP |" in proc.stdout and "| level | gRPC tok/s | HTTP tok/s |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "serve" and result["server_exit_code"] == 0
    assert result["precision"] == {"quantization": "none", "kv_cache_dtype": "auto"}  # the defaults
    by_front = {f: [lv for lv in result["levels"] if lv["front"] == f] for f in ("grpc", "http")}
    same = [lv.get("concurrency") for lv in by_front["grpc"]]
    assert same == [lv.get("concurrency") for lv in by_front["http"]]
    for c in result["http_over_grpc"]:
        assert c["http_over_grpc"] == pytest.approx(c["http_tok_s"] / c["grpc_tok_s"], abs=6e-4)
    assert len(result["http_over_grpc"]) == 3
    for levels in (by_front["http"], by_front["grpc"]):
        levels = {(lv["mode"], lv.get("concurrency") or lv.get("request_rate")): lv for lv in levels}
        _check_serve_levels(levels, result)
    assert out.with_suffix(".md").read_text().startswith("| level |")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _check_cached_tokens(result)


def test_a_cpu_split_keeps_the_server_and_what_it_starts_apart_from_the_clients():
    """--client-cpus N: the clients get the host's last N CPUs, the server the rest; a server pinned
    as it starts passes its CPUs on to the processes it starts afterwards."""
    from tandem.bench.serve.server import CpuSplit

    assert CpuSplit.of(2, [3, 0, 2, 1]) == CpuSplit(clients=(2, 3), measured=(0, 1))
    assert CpuSplit.of(0) == CpuSplit()
    with pytest.raises(SystemExit):
        CpuSplit.of(4, [0, 1, 2, 3])  # nothing left for the server
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to split")
    split = CpuSplit.of(1)
    child = "import os; print(sorted(os.sched_getaffinity(0)))"
    parent = f"import subprocess, sys, time; time.sleep(1); subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    split.pin_measured(proc.pid)
    assert proc.communicate(timeout=60)[0].strip() == str(list(split.measured))
    client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        split.pin_client(client.pid)
        assert sorted(os.sched_getaffinity(client.pid)) == [cpus[-1]]
    finally:
        client.kill()
        client.wait()


def _check_cached_tokens(result: dict) -> None:
    """Two cache blocks of each prompt (the 32-token system prompt) cached, the rest of its 80 not:
    a prompt another pass had sent would be cached to its last full block."""
    prefix, own = result["workload"]["shared_prefix"], result["workload"]["prompt"]
    assert (prefix, own) == (32, 48)
    passes = {lv["pass"] for lv in result["levels"]}
    assert len(passes) == 2 and 0 not in passes  # gRPC's and HTTP's; the engine alone's is 0
    for level in result["levels"]:
        for side in (level["server"], level["engine"]):
            assert side["prompt_tokens"] == (prefix + own) * side["completed"]
            assert side["cached_prompt_tokens"] == prefix * side["completed"]
    by_pass = result["cached_by_pass"]
    assert [p["name"].split(",")[0] for p in by_pass] == ["engine alone", "grpc", "http"]
    for p in by_pass:
        assert p["cached_prompt_tokens"] * (prefix + own) == p["prompt_tokens"] * prefix > 0


def _check_serve_levels(levels: dict, result: dict) -> None:
    assert set(levels) == {("concurrency", 1), ("concurrency", 4), ("request_rate", 20.0)}
    for level in levels.values():
        server, engine = level["server"], level["engine"]
        assert server["errors"] == {} and server["completed"] == server["requests"]
        assert server["tokens"] == engine["tokens"] == server["requests"] * result["workload"]["new"]
        ratio = server["output_tok_s"] / engine["output_tok_s"]
        assert level["server_over_engine"] == pytest.approx(ratio, abs=6e-4)  # rounded to 3 decimals
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert 0 <= server[key]["p50"] <= server[key]["p90"] <= server[key]["p99"]
        assert engine["median_step_ms"] > 0
    assert levels[("concurrency", 4)]["server"]["requests"] == 4


def test_tandem_bench_soak_smoke_finds_the_server_correct(tmp_path, tiny_model_dir):
    """The soak's smoke through the CLI: every API kind answered, cancels of its own seen as such, no
    unexpected status, no lost or duplicated token, every KV block free again, and the report's fields."""
    out = tmp_path / "soak.json"
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(tandem), "bench", "soak", "--smoke", "--model", str(tiny_model_dir("llama")), "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "soak" and report["passed"] is True and report["server_exit_code"] == 0
    run = report["run"]
    assert run["outcomes"] == run["requests"] == 300 and run["stalled"] is None
    assert run["unexpected"]["count"] == 0, run["unexpected"]["examples"]
    assert set(run["statuses"]) == {"native_unary", "native_stream", "kserve_unary", "kserve_stream"}
    assert all(counts.get("OK", 0) > 0 for counts in run["statuses"].values())
    ended = {s for counts in run["statuses"].values() for s, n in counts.items() if n and s != "OK"}
    assert {"CANCELLED", "DEADLINE_EXCEEDED"} <= ended  # the soak's own cancels happened
    tokens = run["tokens"]
    assert tokens["lost_or_duplicated"] == tokens["probe_answers_differing"] == 0, tokens
    assert tokens["finished_checked"] > 200
    answered = [p for p in tokens["probes"].values() if len(p["kinds"]) >= 2]
    assert answered and all(p["distinct_texts"] == 1 for p in answered)
    blocks = report["kv_blocks"]
    assert blocks["leaked"] == 0 and blocks["kv_blocks_free"] == blocks["kv_blocks_total"] > 0
    roles = {p["process"] for p in report["rss"]["processes_end"]}
    assert {"supervisor", "engine", "front-0"} <= roles and report["rss"]["after_warmup_mib"] > 0
    health = report["health"]
    assert health["checks"] > 10 and health["not_serving"] == 0
    assert 0 < health["latency_ms"]["p50"] <= health["latency_ms"]["p99"] <= health["latency_ms"]["max"]
    assert report["throughput"]["generated_tokens"] > 0 and report["throughput"]["requests_s"] > 0
    assert {"unexpected_errors", "lost_or_duplicated_tokens", "leaked_kv_blocks", "rss_growth_pct",
            "health_p99_ms"} <= set(report["targets"])
    assert report["command"].startswith("tandem bench soak --smoke")
    assert "| unexpected_errors | 0 |" in out.with_suffix(".md").read_text()


def test_soak_checks_tell_the_soaks_own_cancels_from_faults():
    """The soak's checks flag a lost token, a repeated final response, a probe answer with a piece
    missing, and statuses the soak did not cause; its own cancels and deadlines pass."""
    from dataclasses import asdict

    from tandem.bench.soak.outcome import Outcome
    from tandem.bench.soak.report import check, targets
    from tandem.bench.soak.workload import SoakRequest

    cases = [  # (request, outcome)
        (SoakRequest(0, "native_stream", "p", 4), Outcome(0, "native_stream", tokens=3, completion_tokens=4,
                                                         finish_reason="FINISH_REASON_LENGTH")),
        (SoakRequest(1, "kserve_stream", "p", 4), Outcome(1, "kserve_stream", finals=[False, True, True])),
        (SoakRequest(2, "native_unary", "p", 4), Outcome(2, "native_unary", status="UNAVAILABLE")),
        (SoakRequest(3, "native_stream", "p", 4, cancel="chunks"),
         Outcome(3, "native_stream", status="CANCELLED", cancelled=True)),
        (SoakRequest(4, "kserve_unary", "p", 4, cancel="deadline"),
         Outcome(4, "kserve_unary", status="DEADLINE_EXCEEDED")),
        (SoakRequest(5, "native_stream", "p", 4), Outcome(5, "native_stream", status="CANCELLED")),
        (SoakRequest(6, "kserve_stream", "p", 4, cancel="timeout_param"),
         Outcome(6, "kserve_stream", error_message="the request ran past its deadline")),
        (SoakRequest(7, "kserve_stream", "p", 4),
         Outcome(7, "kserve_stream", error_message="internal error: x")),
        (SoakRequest(8, "kserve_stream", "p", 4, cancel="deadline"),  # the server's copy of the deadline
         Outcome(8, "kserve_stream", error_message="the request ran past its deadline")),
        (SoakRequest(9, "native_unary", "p", 4, cancel="deadline"),  # the transport's report of it
         Outcome(9, "native_unary", status="INTERNAL", error_message="Internal error from Core")),
        (SoakRequest(10, "native_unary", "p", 4, cancel="deadline"),  # a server fault, deadline or not
         Outcome(10, "native_unary", status="INTERNAL", error_message="an engine step failed")),
    ]
    for i, text in enumerate(["one two", "one two", "one", "one three"], start=20):  # probe 0, greedy
        cases.append((SoakRequest(i, "kserve_unary", "q", 4, probe=0), Outcome(i, "kserve_unary", text=text)))
    result = check([asdict(r) for r, _ in cases], [asdict(o) for _, o in cases])
    assert sorted(b["index"] for b in result["unexpected"]["examples"]) == [2, 5, 7, 10]
    assert [b["index"] for b in result["tokens"]["examples"]] == [0, 1]
    assert "received 3 tokens, usage.completion_tokens 4" in result["tokens"]["examples"][0]["problems"]
    tokens = result["tokens"]
    assert tokens["probe_answers_differing"] == 2 and tokens["probe_answers_spliced"] == 1  # "one" lost "two"
    assert tokens["probes"]["0"]["distinct_texts"] == 3
    report = {"run": result, "kv_blocks": {"leaked": 0}, "rss": {"growth_pct": 1.0},
              "health": {"latency_ms": {}}}
    got = targets(report, strict_probes=False)
    assert got["unexpected_errors"]["value"] == 4 and not got["unexpected_errors"]["met"]
    assert got["lost_or_duplicated_tokens"]["value"] == 3
    assert got["probe_answers_differing"]["correctness"] is False and got["leaked_kv_blocks"]["met"]


def test_soak_plan_is_seeded_and_shared_kserve_calls_cancel_together():
    """The same seed gives the same requests; about the asked share is cancelled; requests riding
    another's KServe stream follow it and share its client-side cancel."""
    from tandem.bench.soak.workload import KINDS, Mix, as_dicts, calls, plan

    requests = as_dicts(plan(2000, Mix(), seed=3))
    assert requests == as_dicts(plan(2000, Mix(), seed=3)) != as_dicts(plan(2000, Mix(), seed=4))
    assert {r["kind"] for r in requests} == set(KINDS)
    leads = [r for r in requests if r["call"] is None]
    assert 0.07 < sum(r["cancel"] is not None for r in leads) / len(leads) < 0.13
    units = calls(requests)
    assert sorted(r["index"] for u in units for r in u) == [r["index"] for r in requests]
    shared = [u for u in units if len(u) > 1]
    assert shared and all(r["kind"] == "kserve_stream" and r["call"] == u[0]["index"] for u in shared
                          for r in u[1:])
    for u in shared:
        if u[0]["cancel"] in ("chunks", "deadline"):
            assert all((r["cancel"], r["deadline_s"]) == (u[0]["cancel"], u[0]["deadline_s"]) for r in u)
        assert all(r["cancel"] != "timeout_param" for r in u)  # an error response names no request


def test_tandem_bench_workloads_smoke_runs_each_workload_beside_its_feature_off(tmp_path):
    """`tandem bench workloads --smoke`: every workload runs to completion through the CLI, each
    side by side with its feature off, and the JSON says what each run did: the oversubscribed
    runs preempt (by offload in one, recompute in the other), the prefix run with caching hits
    and the one without does not, the mixed run's bound, GEMM floor and step kinds add up, a smaller
    step budget chunks the same prompts into more steps, and the host profile names the mixed
    attention op among the launches' functions."""
    out = tmp_path / "workloads.json"
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(tandem), "bench", "workloads", "--smoke", "--host-profile", "--budgets", "2048,96",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    mixed, small = report["mixed"]  # one seed at each budget, the first one's first
    assert (mixed["budget"], small["budget"]) == (2048, 96) and mixed["seed"] == small["seed"]
    for kind in small["step_kinds"].values():  # no step takes more tokens than its budget
        assert kind["prompt_tokens_mean"] + kind["decode_rows_mean"] <= 96
    assert small["steps"] > mixed["steps"]  # the same prompts in smaller chunks
    for latency in ("ttft", "tpot", "itl"):  # each run's latencies, as the host got the tokens
        assert 0 < mixed[f"{latency}_p50_ms"] <= mixed[f"{latency}_p99_ms"]
    bound = mixed["additive_bound"]
    assert bound["seconds"] == pytest.approx(bound["decode_memory_s"] + bound["prompt_gemm_s"], abs=2e-3)
    assert mixed["of_bound"] == pytest.approx(bound["seconds"] / mixed["seconds"], rel=0.01, abs=1e-3)
    kinds = mixed["step_kinds"]
    assert sum(k["steps"] for k in kinds.values()) == mixed["steps"] and kinds["mixed"]["steps"] > 0
    assert kinds["mixed"]["launch_ms_p50"] <= kinds["mixed"]["launch_ms_max"]
    # what could have held up a step: the collector's full walks, compiles (the CPU engine: none)
    assert mixed["stalls"]["gc_full_collections"] >= 0 and mixed["stalls"]["kernel_variants_compiled"] == 0
    # each kind's own bound: together the run's; the decode-only steps by batch size: all of them
    assert sum(k["bound_s"] for k in kinds.values()) == pytest.approx(bound["seconds"], abs=5e-3)
    by_rows = mixed["decode_by_rows"]
    assert sum(g["steps"] for g in by_rows.values()) == kinds["decode"]["steps"]
    assert 0 < mixed["device_busy"] <= 1 and all(0 < k["of_bound"] for k in kinds.values())
    # the GEMM floor of each step: every kind's, together the run's
    assert mixed["gemm_floor_s"] > 0
    floor = mixed["gemm_floor_s"]
    assert mixed["of_gemm_floor"] == pytest.approx(floor / mixed["seconds"], rel=0.01, abs=1e-3)
    assert sum(k["floor_s"] for k in kinds.values()) == pytest.approx(floor, abs=5e-3)
    host = report["mixed_host_profile"]
    assert host["steps"] == kinds["mixed"]["steps"]  # the profiled run schedules as the timed one
    # the mixed attention op's code (its module: the op's work is split among its functions)
    assert any(name.startswith("mixed_op.py:") for name in host["own_ms_per_step"])
    prefix = report["prefix"]
    assert prefix["on"]["prefix_hit_rate"] > 0 and prefix["off"]["prefix_hit_rate"] == 0
    for shape in report["oversubscribed"]:
        offload, recompute = shape["offload"], shape["recompute"]
        assert offload["preemptions_offload"] > 0 and offload["preemptions_recompute"] == 0
        assert recompute["preemptions_recompute"] > 0 and recompute["preemptions_offload"] == 0
        assert shape["same_tokens"] == shape["requests"]  # fp32 on the CPU: the same greedy tokens
        assert shape["recomputed_tokens"] > 0 and shape["ratio_bound"] >= 1.0  # what offload can save
    assert report["long"]["new"] * report["long"]["requests"] == pytest.approx(
        report["long"]["tok_s"] * report["long"]["seconds"], rel=0.01)


def test_tandem_bench_host_times_each_stage_of_the_engines_host_work(tmp_path):
    """`tandem bench host --smoke`: the engine core's own loop with the forward replaced, at each
    point the batch asked for (every sequence decoding, or decodes beside prompt chunks), and the
    stages it reports are the step's time, split."""
    out = tmp_path / "host.json"
    proc = _bench(tmp_path, "host", "--smoke", "--workload-seeds", "1", "--out", str(out))
    assert "| decode |" in proc.stdout and "| mixed |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "host_step" and report["smoke"] is True
    for p in report["points"]:
        if p["kind"] == "decode":  # every sequence decodes in every timed step
            assert p["decode_rows_mean"] == p["batch"] and p["prompt_tokens_mean"] == 0
        else:  # prompt chunks beside the decodes, up to the step's token budget
            assert p["decode_rows_mean"] == p["batch"] and p["prompt_tokens_mean"] > 0
            budget = report["engine"]["max_num_batched_tokens"]
            assert p["decode_rows_mean"] + p["prompt_tokens_mean"] <= budget
        stages = p["stages_ms"]
        assert all(stages[s] > 0 for s in ("schedule", "build", "upload", "process"))
        assert (stages["metadata"] > 0) == (p["kind"] == "mixed")  # packed prompt chunks: mixed steps
        assert stages["other"] >= 0 and sum(stages.values()) == pytest.approx(p["ms_mean"], abs=0.01)
        assert p["ms_p50"] <= p["ms_p99"]
    (workload,) = report["mixed_workload"]  # the mixed workload's steps, every one counted once
    kinds = workload["by_kind"]
    assert "mixed" in kinds and any(k.startswith("decode") for k in kinds)
    assert workload["steps"] == sum(g["steps"] for g in kinds.values()) > 0
    assert all(0 < g["ms_mean"] <= g["ms_p99"] + 1e-9 for g in kinds.values())


def test_tandem_bench_workloads_model_schedules_the_mixed_workload_at_each_budget(tmp_path):
    """`tandem bench workloads --model`: the mixed workload's exact schedules on the CPU, one per seed
    and budget: a larger budget takes the same prompts in fewer steps, with longer steps for the
    sequences decoding beside them."""
    out = tmp_path / "model.json"
    _bench(tmp_path, "workloads", "--model", "--requests", "48", "--seeds", "1", "--budgets", "512,2048",
           "--out", str(out))
    small, large = json.loads(out.read_text())["mixed_model"]
    assert (small["budget"], large["budget"]) == (512, 2048)
    assert small["steps"] > large["steps"] and small["mixed_steps"] > large["mixed_steps"]
    assert small["longest_decode_step_ms"] < large["longest_decode_step_ms"]
    for r in (small, large):
        assert r["decode_memory_s"] < r["bound_s"]  # and the prompts' GEMM work besides


def test_tandem_bench_offload_bound_models_each_shapes_two_schedules(tmp_path):
    """`tandem bench offload-bound --smoke`: each shape runs once with a host pool (every preempted
    sequence offloaded, its prompt computed once) and once without (preempted ones recomputed, so
    more prompt tokens), and the modelled ratio is the two modelled times' quotient."""
    out = tmp_path / "offload.json"
    _bench(tmp_path, "offload-bound", "--smoke", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["benchmark"] == "offload_bound" and len(report["shapes"]) == 2
    for shape in report["shapes"]:
        off, rec = shape["offload"], shape["recompute"]
        assert off["preemptions_offload"] > 0 and off["preemptions_recompute"] == 0
        assert rec["preemptions_recompute"] > 0 and rec["preemptions_offload"] == 0
        assert off["prompt_tokens"] == shape["requests"] * shape["prompt"]  # each prompt once
        assert shape["recomputed_tokens"] == rec["prompt_tokens"] - off["prompt_tokens"] > 0
        assert shape["modelled_ratio"] == pytest.approx(rec["modelled_s"] / off["modelled_s"], rel=1e-3)
        assert shape["cache_tokens"] * shape["oversubscribed"] == pytest.approx(
            shape["requests"] * (shape["prompt"] + shape["new"]), rel=0.05)


def _bench(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`tandem bench ARGS` from the installed CLI, as a user runs it (the repository root not on
    sys.path); asserts it exits 0."""
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run([str(tandem), "bench", *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_tandem_bench_resolves_every_name_to_the_main_of_its_module(capsys):
    """Every `tandem bench NAME` imports a module of the tandem.bench package (no script path: it
    runs from an installed wheel) and calls its main(argv), whose usage names the command."""
    from tandem.bench import BENCHMARKS, main_of

    assert {"gpu", "serve", "soak", "workloads", "host", "autoscale"} <= set(BENCHMARKS)
    for name, module in BENCHMARKS.items():
        main = main_of(name)
        assert callable(main) and main.__module__ == f"tandem.bench.{module}"
        with pytest.raises(SystemExit) as exit_:
            main(["--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: tandem bench {name} ")


def test_result_files_are_named_by_date_gpu_benchmark_and_shape(tmp_path, monkeypatch):
    """`<date>_<gpu>_<benchmark>_<shape>.json` in bench/results/ of a checkout (the current directory
    outside one); every record states the command line, the date, the GPU and the commit."""
    import datetime

    from tandem.bench import record
    from tandem.bench.record import ResultFile, short_gpu

    names = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "cpu")
    assert [short_gpu(n) for n in names] == ["h100", "h200", "a100", "cpu"]
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    result = ResultFile("offload-bound", ["--smoke"], "cpu", "8b")
    assert result.path == REPO / "bench" / "results" / f"{today}_cpu_offload-bound_8b.json"
    result = ResultFile("serve", ["--shape", "8b"], "cpu", "8b-fixed-grpc+http", folder=tmp_path)
    assert result.path == tmp_path / f"{today}_cpu_serve_8b-fixed-grpc+http.json"
    assert ResultFile("x", [], "cpu", "a_b", folder=tmp_path).path.name == f"{today}_cpu_x_a-b.json"
    written = json.loads(result.write({"benchmark": "serve", "levels": []}, markdown="| level |").read_text())
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert written["command"] == "tandem bench serve --shape 8b"
    # where a run wrote its files is no fact of the result (and a path of the machine it ran on)
    argv = ["--shape", "8b", "--out", "/root/out/a.json", "--logs=/root/out/logs", "--timeline", "t.json",
            "--plot", "p.png", "--requests", "16"]
    assert record.command("start", argv) == "tandem bench start --shape 8b --requests 16"
    assert (written["date"], written["gpu"], written["commit"].removesuffix("+dirty")) == (today, "cpu", head)
    assert written["environment"]["cpu_cores"] >= 1 and written["levels"] == []
    assert result.path.with_suffix(".md").read_text() == "| level |\n"
    with pytest.raises(AssertionError):  # the facts are the writer's alone
        result.write({"date": "yesterday"})
    monkeypatch.setattr(record, "RESULTS", tmp_path / "no-results")  # as installed from a wheel
    monkeypatch.chdir(tmp_path)
    outside = ResultFile("gpu", [], "cpu", "8b-32x256")
    assert outside.path == tmp_path / f"{today}_cpu_gpu_8b-32x256.json"
    version = record.versions("tandem")["tandem"]
    assert json.loads(outside.write({}).read_text())["commit"] == f"tandem {version}"


def test_serve_passes_send_prompts_of_their_own_of_the_same_lengths():
    """`tandem bench serve` gives the engine alone and each front its own pass: the same lengths level
    by level, and no 16-token block at the start of any prompt (warm-up included) that another pass
    sends; within a pass, every request starts with the pass's system prompt, then tokens no other
    level of the pass sends. `--front both` is `grpc,http`."""
    from tandem.bench.serve.benchmark import make_pass, parse_args

    block = 16

    def starts(p, skip: int = 0) -> list[tuple[int, ...]]:
        levels = [*p.levels, p.warmup]
        return [tuple(j["prompt_ids"][skip : skip + block]) for lv in levels for j in lv["jobs"]]

    for shared in (0, 32):
        a = parse_args(["--shape", "tiny", "--concurrency", "1,4", "--request-rate", "2,8",
                        "--num-prompts", "6", "--prompt", "40", "--shared-prefix", str(shared)])
        passes = [make_pass(a, 512, 2048, n, f"pass {n}") for n in range(3)]

        def lengths(p):
            return [[(len(j["prompt_ids"]), j["max_tokens"], j["at"]) for j in lv["jobs"]] for lv in p.levels]

        assert lengths(passes[0]) == lengths(passes[1]) == lengths(passes[2])
        for i, p in enumerate(passes):
            for q in passes[i + 1:]:
                assert not set(starts(p)) & set(starts(q))
            own = starts(p, skip=shared)  # past the system prompt: every request's own
            assert len(set(own)) == len(own)
            if shared:
                assert len({tuple(j["prompt_ids"][:shared]) for lv in p.levels for j in lv["jobs"]}) == 1
    assert parse_args(["--shape", "tiny", "--front", "both"]).front == ["grpc", "http"]
    assert parse_args(["--shape", "tiny", "--front", "http,grpc"]).front == ["http", "grpc"]
    with pytest.raises(SystemExit):
        parse_args(["--shape", "tiny", "--front", "grpc,rest"])


def test_benchmarks_run_without_the_cli_and_from_a_checkout_not_installed(tmp_path):
    """`python -m tandem.bench NAME` runs a benchmark without the CLI's settings and gRPC, and
    `python bench NAME` runs it from the checkout's own folders (as on a GPU host with only torch
    and transformers, Tandem not installed)."""
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    for how in (["-m", "tandem.bench"], [str(REPO / "bench")]):
        out = tmp_path / f"offload{len(how)}.json"
        proc = subprocess.run([sys.executable, *how, "offload-bound", "--smoke", "--out", str(out)],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads(out.read_text())
        assert report["benchmark"] == "offload_bound" and len(report["shapes"]) == 2
        assert report["command"] == "tandem bench offload-bound --smoke"  # not where it wrote


def test_tandem_bench_fp8_smoke_runs_each_variant_on_each_workload(tmp_path):
    """bf16 beside FP8 linear layers on the CPU: every workload on every engine, the ratio to the
    first variant, the FP8 engine holding e4m3 weights (fewer weight bytes) and tokens of its own."""
    out = tmp_path / "fp8.json"
    tandem = Path(sys.executable).with_name("tandem")
    subprocess.run([str(tandem), "bench", "fp8", "--smoke", "--variants", "bf16,w8a8", "--out", str(out),
                    "--inductor", "split_reductions=False"],
                   check=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"})
    result = json.loads(out.read_text())
    assert result["benchmark"] == "fp8" and result["smoke"] is True
    assert result["inductor"] == {"split_reductions": False}  # what the run set, recorded
    bf16, w8a8 = result["variants"]["bf16"], result["variants"]["w8a8"]
    assert set(bf16["workloads"]) == set(w8a8["workloads"]) == {"1x8+4", "4x8+6"}
    assert w8a8["weight_GB"] < bf16["weight_GB"]
    assert set(result["ratio_to_bf16"]["w8a8"]) == {"1x8+4", "4x8+6"}
    assert all(r["tok_s"] > 0 for r in w8a8["workloads"].values())
    for run in (*bf16["workloads"].values(), *w8a8["workloads"].values()):
        # where the wall time went: the prompt steps (and any stall) apart from the decode steps
        assert run["steps"] > 0 and run["step_ms"]["median"] <= run["step_ms"]["max"]
        assert run["slow_steps"]["count"] <= run["steps"]
        assert 0 <= run["slow_steps"]["seconds"] <= run["seconds"]


def test_slow_steps_are_those_past_three_medians():
    from tandem.bench.engine.harness import slow_steps

    # a prompt step of 40 ms and a stall of 35 among steps of about 10 (median 10.5, so a step of 30
    # is not one): 75 ms of a 0.2 s run
    assert slow_steps([40.0, 10.0, 10.5, 9.5, 35.0, 10.0, 30.0], 0.2) == {
        "count": 2, "seconds": 0.075, "of_wall": 0.375}


@pytest.mark.parametrize(("pair", "why"), [
    ("no_such_choice=1", "has no 'no_such_choice'"),
    ("triton.no_such_choice=1", "has no 'triton.no_such_choice'"),
    ("no_such_group.enable_pdl=1", "has no 'no_such_group.enable_pdl'"),
    ("split_reductions=nope", "not a Python literal"),
    ("split_reductions", "expected NAME=VALUE"),
])
def test_an_inductor_choice_a_benchmark_cannot_set_is_refused(pair, why):
    from torch._inductor import config

    from tandem.bench.engine import inductor_options

    before = config.split_reductions
    with pytest.raises(ValueError, match=why):
        inductor_options.apply([pair])
    assert config.split_reductions == before


def test_an_inductor_choice_in_a_nested_group_is_set_where_inductor_reads_it():
    from torch._inductor import config

    from tandem.bench.engine import inductor_options

    before = config.triton.enable_pdl
    try:
        assert inductor_options.apply(["triton.enable_pdl=True"]) == {"triton.enable_pdl": True}
        assert config.triton.enable_pdl is True
    finally:
        config.triton.enable_pdl = before


def test_bench_gpu_runs_each_precision_beside_the_first_and_reports_the_ratios(tmp_path, monkeypatch):
    """`--quantization none,fp8 --kv-cache-dtype auto,fp8`: four engines of one run, each built with
    its precision in its EngineConfig, each timed, and each FP8 one's tokens/s over the bf16 one's.
    The plumbing only: the cores are built without the FP8 settings, which the CPU need not run."""
    import dataclasses

    from tandem.bench.engine import gpu_sync
    from tandem.service.engine.core_builder import build_core

    built = []

    def recording(model, config, *args):
        built.append(config)
        return build_core(model, dataclasses.replace(config, quantization=None, kv_cache_dtype="auto"), *args)

    monkeypatch.setattr(gpu_sync, "build_core", recording)
    out = tmp_path / "gpu.json"
    argv = ["--smoke", "--skip-hf", "--quantization", "none,fp8", "--kv-cache-dtype", "auto,fp8",
            "--out", str(out)]
    assert gpu_sync.main(argv) == 0
    assert [(c.quantization, c.kv_cache_dtype) for c in built] == [
        (None, "auto"), (None, "fp8"), ("fp8", "auto"), ("fp8", "fp8")
    ]
    result = json.loads(out.read_text())
    assert result["workload"]["precisions"] == [
        {"quantization": q, "kv_cache_dtype": kv} for q in ("none", "fp8") for kv in ("auto", "fp8")
    ]
    runs = ("tandem+kv-fp8", "tandem+fp8", "tandem+fp8+kv-fp8")
    for name in ("tandem", *runs):
        assert result[name]["tokens"] == result["workload"]["requests"] * result["workload"]["new_tokens"]
    assert result["tandem+fp8+kv-fp8"]["engine"]["quantization"] == "fp8"
    assert result["tandem+fp8+kv-fp8"]["engine"]["kv_cache_dtype"] == "fp8"
    assert set(result["precision_ratios"]) == set(runs)
    for name, ratio in result["precision_ratios"].items():
        assert ratio["over"] == "tandem"
        assert ratio["tok_s"] == pytest.approx(result[name]["tok_s"] / result["tandem"]["tok_s"], rel=0.01)
    # an FP8 K/V cache is read at half the bytes: its roofline is its own
    kv = result["tandem+kv-fp8"]["roofline"]["kv_KiB_per_token"]
    assert kv == result["roofline"]["kv_KiB_per_token"] / 4  # the smoke's model is float32: 4 bytes -> 1
    assert "roofline" not in result["tandem"]
    # and its GEMM floor too: the same K/V read at a quarter of the bytes, each run's share of its own
    own = result["tandem+kv-fp8"]["gemm_floor"]
    base = result["gemm_floor"]
    assert own["decode_kv_read_seconds"] == pytest.approx(base["decode_kv_read_seconds"] / 4, rel=0.02)
    run = result["tandem+kv-fp8"]  # its share of its own floor (the report's seconds are rounded)
    assert run["fraction_of_gemm_floor"] == pytest.approx(own["seconds"] / run["seconds"], rel=0.05)
    assert "gemm_floor" not in result["tandem"]


@pytest.mark.parametrize(
    "bad", [["--quantization", "int4"], ["--kv-cache-dtype", "fp16"], ["--quantization", ""]]
)
def test_bench_gpu_refuses_unknown_precisions(bad):
    from tandem.bench.engine.gpu_sync import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--smoke", *bad])


def test_serve_precision_flags_reach_the_server_and_the_engine_alone_alike(monkeypatch):
    """`tandem bench serve --quantization fp8 --kv-cache-dtype fp8`: the settings of the one
    environment both the server and the engine alone are started with (after --set, so they win);
    `--quantization none` unsets the setting even where this process's environment has it."""
    from tandem.bench.serve.benchmark import parse_args
    from tandem.bench.serve.server import precision_sets, settings_env
    from tandem.service.settings import ServerSettings

    a = parse_args(["--shape", "tiny", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
                    "--set", "kv_cache_dtype=auto"])
    env = settings_env([*a.set, *precision_sets(a)], "cpu")
    assert (env["TANDEM_QUANTIZATION"], env["TANDEM_KV_CACHE_DTYPE"]) == ("fp8", "fp8")
    for name, value in env.items():  # as the server and `engine_alone` read their settings
        if name.startswith("TANDEM_"):
            monkeypatch.setenv(name, value)
    settings = ServerSettings()
    assert (settings.quantization, settings.kv_cache_dtype) == ("fp8", "fp8")

    monkeypatch.setenv("TANDEM_QUANTIZATION", "fp8")
    monkeypatch.delenv("TANDEM_KV_CACHE_DTYPE")
    a = parse_args(["--shape", "tiny", "--quantization", "none"])
    env = settings_env([*a.set, *precision_sets(a)], "cpu")
    assert "TANDEM_QUANTIZATION" not in env and "TANDEM_KV_CACHE_DTYPE" not in env
    with pytest.raises(SystemExit):
        parse_args(["--shape", "tiny", "--kv-cache-dtype", "fp16"])


def test_bench_workloads_precision_flags_reach_the_engine_and_the_report(monkeypatch):
    """`tandem bench workloads --quantization fp8 --kv-cache-dtype fp8`: the one engine every workload
    runs on is built with them, its cache holds FP8 K/V (four times the float32 smoke's tokens in the
    same GiB) and the report says so. The plumbing only: the core is built without the FP8 settings."""
    import dataclasses

    from tandem.bench.workloads import features
    from tandem.service.engine.core_builder import build_core

    built = []

    def recording(model, config, *args):
        built.append(config)
        return build_core(model, dataclasses.replace(config, quantization=None, kv_cache_dtype="auto"), *args)

    monkeypatch.setattr(features, "build_core", recording)
    plain, plain_report = features.build_bench(features.parse_args(["--smoke"]))
    fp8, report = features.build_bench(
        features.parse_args(["--smoke", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    )
    assert [(c.quantization, c.kv_cache_dtype) for c in built] == [(None, "auto"), ("fp8", "fp8")]
    assert (report["engine"]["quantization"], report["engine"]["kv_cache_dtype"]) == ("fp8", "fp8")
    plain_engine = plain_report["engine"]
    assert (plain_engine["quantization"], plain_engine["kv_cache_dtype"]) == ("none", "auto")
    assert report["kv_KiB_per_token"] == plain_report["kv_KiB_per_token"] / 4
    assert 0 <= fp8.cache_blocks - 4 * plain.cache_blocks < 4  # the same GiB, whole blocks


def test_bench_fp8_sizes_its_cache_by_the_workload_that_holds_the_most_tokens():
    """A few long generations beside many short ones: the cache holds the larger of the two at once,
    not the most requests at the longest length (which no GPU holds for the 8B shape)."""
    from tandem.bench.engine.fp8 import engine_config, parse_args
    from tandem.bench.engine.harness import blocks_for

    a = parse_args(["--variants", "bf16", "--workloads", "256x128+256,8x512+16384"])
    config = engine_config(a, "bf16")
    assert config.num_blocks == blocks_for(8, 512 + 16384, 16) > blocks_for(256, 128 + 256, 16)
    assert config.max_num_seqs == 256


def test_tandem_bench_start_times_each_start_by_phase_and_its_first_requests(tmp_path):
    """Two fresh servers on one cache directory: each reaches SERVING, reports every phase (the
    first converts the embedded GGUF into the empty cache, the second finds it there: fewer seconds
    of weights), and answers its first requests, timed against the later ones; each server's log is
    kept (--logs), with the parts of its kv_cache phase; each start found the weights evicted
    (--evict-weights), and the server read them ahead of its engine's imports."""
    from tandem.service.telemetry.startup import PHASES

    out, logs = tmp_path / "start.json", tmp_path / "logs"
    tandem = Path(sys.executable).with_name("tandem")
    subprocess.run([str(tandem), "bench", "start", "--smoke", "--runs", "cold,warm", "--requests", "6",
                    "--evict-weights", "--out", str(out), "--logs", str(logs)], check=True, timeout=600,
                   cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"})
    for run in ("cold", "warm"):
        said = (logs / f"server-{run}.log").read_text()
        assert "KV cache allocated in" in said and "view of the vocabulary built in" in said
        assert "of weights ahead of the engine's imports" in said  # the GGUF, then its safetensors
    result = json.loads(out.read_text())
    assert result["benchmark"] == "start" and list(result["runs"]) == ["cold", "warm"]
    assert result["weights_evicted"] is True
    cold, warm = result["runs"]["cold"], result["runs"]["warm"]
    for run in (cold, warm):
        assert set(run["phases_s"]) == set(PHASES)
        assert 0 < run["server_serving_s"] <= run["serving_s"] + 1.0
        assert sum(run["phases_s"].values()) <= run["server_serving_s"] + 0.1
        assert run["ttft_first_half_median_ms"] > 0 and run["ttft_second_half_median_ms"] > 0
    assert warm["phases_s"]["weights"] < cold["phases_s"]["weights"]


def test_tandem_bench_structured_runs_both_sides_on_the_same_tokens(tmp_path):
    """`tandem bench structured` on a random tiny shape with the embedded tokenizer: the constrained
    and the unconstrained runs make the same tokens (each free request as long as its constrained
    twin), the one schema compiled once, and the ratio is theirs; then each new schema of the
    first-time TTFT is compiled once and its repeat found cached."""
    out = tmp_path / "structured.json"
    tandem = Path(sys.executable).with_name("tandem")
    subprocess.run([str(tandem), "bench", "structured", "--shape", "tiny", "--streams", "4",
                    "--requests", "8", "--max-tokens", "24", "--first-time", "3", "--out", str(out)],
                   check=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"},
                   capture_output=True)
    result = json.loads(out.read_text())
    assert result["model"] == "random-tiny" and result["grammar_compiles"] == 1
    # the record names its run, as every benchmark's does
    assert result["command"].startswith("tandem bench structured --shape tiny") and result["commit"]
    assert result["date"] and result["gpu"] and result["smoke"] is False
    ttft = result["first_time_schema_ttft"]
    assert ttft["requests"] == 3 and ttft["grammar_compiles"] == 3
    assert 0 < ttft["cached_ms"] and 0 < ttft["first_time_ms"]
    assert ttft["ratio"] == pytest.approx(ttft["first_time_ms"] / ttft["cached_ms"], rel=0.01)
    assert result["tokens"] > 0 and result["requests"] == 8
    speeds = result["constrained_tok_s"] / result["unconstrained_tok_s"]
    assert result["ratio"] == pytest.approx(speeds, rel=0.01)
    # the same tokens in batches of the same sizes: as many steps; the constrained ones did grammar work
    assert result["steps"]["constrained"] == result["steps"]["unconstrained"] > 0
    assert result["host_grammar_ms_per_step"]["fill"] > 0 and result["host_grammar_ms_per_step"]["accept"] > 0
    assert result["ms_per_step"]["constrained"] > result["host_grammar_ms_per_step"]["fill"]
