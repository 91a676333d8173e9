"""Write charts/tandem/dashboards/tandem.json, the Grafana dashboard of a Tandem deployment.

Generated rather than hand-edited so that every panel has the same shape; run it after changing a
panel. The queries use the metrics of docs/telemetry.md, plus kube-state-metrics for replicas.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "charts" / "tandem" / "dashboards" / "tandem.json"
SEL = 'namespace=~"$namespace", pod=~"$pod"'
OP = 'namespace=~"$namespace"'  # the operator's series: the ModelServer's namespace (honorLabels)
DS = {"type": "prometheus", "uid": "${datasource}"}


def _cost_by_quantization() -> str:
    """Cost per million tokens of each (quantization, KV-cache dtype): the pods' costs weighted by their
    generated tokens, i.e. the group's price per hour over its tokens per hour. tandem_model_info gives
    each pod's series the labels of what the pod serves."""
    tokens = f"rate(tandem_generation_tokens_total{{{SEL}}}[5m])"
    cost = f"tandem_cost_per_million_tokens_usd{{{SEL}}}"
    info = f"on (namespace, pod) group_left (quantization, kv_cache_dtype) tandem_model_info{{{SEL}}}"
    by = "sum by (quantization, kv_cache_dtype)"
    return f"{by} ({cost} * on (namespace, pod) {tokens} * {info}) / {by} ({tokens} * {info})"


def _quantiles(metric: str, window: str = "5m") -> list[tuple[str, str]]:
    return [
        (
            f'histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}[{window}])))',
            f"p{int(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


# title, unit, [(expr, legend)], width, description
PANELS = [
    ("GPU idle fraction", "percentunit", [(f"tandem_gpu_idle_fraction{{{SEL}}}", "{{pod}}")], 12,
     "Share of the telemetry window with no engine step in flight (1 = idle)."),
    ("Cost per million tokens", "currencyUSD",
     [(f"tandem_cost_per_million_tokens_usd{{{SEL}}}", "{{pod}}")], 12,
     "Price per GPU-hour x GPUs / generated tokens per hour x 1e6, over the window; absent with no tokens."),
    ("Cost per million tokens by quantization", "currencyUSD", [
        (_cost_by_quantization(), "weights {{quantization}}, KV {{kv_cache_dtype}}"),
    ], 24, "Cost per million generated tokens of the pods of each quantization and KV-cache dtype "
     "(tandem_model_info's labels), each pod's cost weighted by its tokens: what FP8 saves."),
    ("Tokens per second", "short", [
        (f"sum(rate(tandem_generation_tokens_total{{{SEL}}}[1m]))", "generated"),
        (f"sum(rate(tandem_prompt_tokens_total{{{SEL}}}[1m]))", "prompt"),
    ], 12, "Generated and prompt tokens per second, all pods."),
    ("Replicas", "short", [
        ('sum(kube_deployment_status_replicas{namespace=~"$namespace"})', "replicas (kube-state-metrics)"),
        (f"count(tandem_gpu_idle_fraction{{{SEL}}})", "pods reporting"),
    ], 12, "Model-server pods: the Deployment's replicas and the pods whose /metrics are scraped."),
    ("Time to first token", "s", _quantiles("gen_ai_server_time_to_first_token_seconds"), 8,
     "gen_ai.server.time_to_first_token percentiles, all pods."),
    ("Time per output token", "s", _quantiles("gen_ai_server_time_per_output_token_seconds"), 8,
     "gen_ai.server.time_per_output_token percentiles, all pods."),
    ("Request duration", "s", _quantiles("gen_ai_server_request_duration_seconds"), 8,
     "gen_ai.server.request.duration percentiles, all pods."),
    ("Queue", "short", [
        (f"sum(tandem_requests_waiting{{{SEL}}})", "waiting"),
        (f"sum(tandem_requests_running{{{SEL}}})", "running"),
    ], 8, "Requests waiting for admission and running in the batch, all pods."),
    ("KV-cache usage", "percentunit", [(f"tandem_kv_cache_usage_ratio{{{SEL}}}", "{{pod}}")], 8,
     "Share of KV-cache blocks in use."),
    ("Prefix-cache hit rate", "percentunit", [(
        f"sum(rate(tandem_prefix_cache_hits_total{{{SEL}}}[5m])) "
        f"/ sum(rate(tandem_prefix_cache_queries_total{{{SEL}}}[5m]))",
        "prompt tokens found cached",
    )], 8, "Share of admitted prompt tokens whose K/V were found in the prefix cache (prefill skipped)."),
    ("Capacity used", "percentunit", [(f"tandem_capacity_utilization{{{SEL}}}", "{{pod}}")], 12,
     "Generated tokens/s over what the pod could make at its traffic's mix (fitted from its own steps): "
     "1 - spare capacity."),
    ("Capacity", "short", [(f"tandem_capacity_tokens_per_second{{{SEL}}}", "{{pod}}")], 12,
     "Generated tokens per second each pod could make at its traffic's mix, at the largest batch it holds."),
    ("Engine step time (p99) by stage", "s", [
        (
            "histogram_quantile(0.99, sum by (le, stage) "
            f"(rate(tandem_step_duration_seconds_bucket{{{SEL}}}[5m])))",
            "{{stage}}",
        )
    ], 8, "tandem_step_duration_seconds: prepare, h2d, compute, d2h and the whole step."),
    ("Preemptions", "short", [
        (f"sum by (mode) (rate(tandem_preemptions_total{{{SEL}}}[5m]))", "{{mode}} /s"),
        (f"max(tandem_kv_offload_usage_ratio{{{SEL}}})", "host pool used (max over pods)"),
    ], 8, "Requests preempted per second when the KV cache ran out, by mode (offload = K/V copied to the "
     "host pool and back, recompute = prefilled again), and the share of the host pool in use."),
    ("Engine garbage-collection pauses", "percentunit", [
        (f"max by (generation) (rate(tandem_engine_gc_pause_seconds_total{{{SEL}}}[5m]))",
         "generation {{generation}} (max over pods)"),
    ], 8, "Share of the engine process's time its step loop stood still in Python garbage collections, "
     "by generation (2 = full). Its start-up objects are frozen out of the walks, so this stays near 0."),
    ("Start-up by phase", "s", [
        (f"max by (phase) (tandem_startup_seconds{{{SEL}}})", "{{phase}} (max over pods)"),
        (f"max(tandem_startup_serving_seconds{{{SEL}}})", "to SERVING (max over pods)"),
    ], 8, "Seconds of each pod's start-up in each phase (spawn and imports, weights, kv_cache, compile, "
     "graph_capture, warm_up) and from its process's start to SERVING: a pod that found a shared compile "
     "cache spends little in compile."),
    # the operator's own metrics (docs/operator.md): what the autoscaler decided, and why
    ("Autoscaler: replicas", "short", [
        (f"sum by (modelserver) (tandem_operator_replicas{{{OP}}})", "{{modelserver}} replicas"),
        (f"sum by (modelserver) (tandem_operator_desired_replicas{{{OP}}})", "{{modelserver}} desired"),
        (f"sum by (modelserver) (tandem_operator_ready_replicas{{{OP}}})", "{{modelserver}} ready"),
    ], 8, "Each ModelServer's replicas, the replicas the operator's last decision asked for, and the "
     "ready pods (status.replicas, status.desiredReplicas, status.readyReplicas)."),
    ("Autoscaler: decisions", "short", [
        (f"sum by (action, reason) (rate(tandem_operator_decisions_total{{{OP}}}[15m]))",
         "{{action}} ({{reason}})"),
    ], 8, "Scaling decisions per second by action and reason (one per tick of each ModelServer; Hold "
     "included, with the reason it held)."),
    ("Autoscaler: failed scrapes and tick time", "short", [
        (f"sum by (problem) (rate(tandem_operator_scrape_failures_total{{{OP}}}[5m]))", "{{problem}} /s"),
        ("histogram_quantile(0.99, sum by (le) (rate(tandem_operator_tick_duration_seconds_bucket[10m])))",
         "tick p99 (s)"),
        ("max(tandem_operator_leader)", "a leader acts (1)"),
    ], 8, "Ready pods whose /metrics the operator could not use, by problem; the p99 time of one scaling "
     "tick; whether an operator replica holds the leader Lease."),
    ("Autoscaler: bursts learned", "short", [
        (f"max by (modelserver) (tandem_operator_burst_growth_ratio{{{OP}}})", "{{modelserver}} growth (x)"),
        (f"max by (modelserver) (tandem_operator_burst_headroom_replicas{{{OP}}})",
         "{{modelserver}} headroom pods"),
    ], 8, "The load's growth within one pod start the policy learned from the last day (the 90th "
     "percentile of each hour's highest), and the pods that carry it (0 with burstHeadroom off): the "
     "replicas stay at or above them (docs/operator.md#scaling-ahead-of-bursts)."),
    ("Autoscaler: pod start", "s", [
        (f"max by (modelserver) (tandem_operator_pod_start_seconds{{{OP}}})", "{{modelserver}}"),
    ], 8, "Seconds from a scale-up to its pods ready, the slowest of the last four the operator "
     "measured (spec.scaling.podStartSeconds until one is): the time the burst headroom bridges."),
]  # fmt: skip


def _panel(i: int, x: int, y: int, title: str, unit: str, targets: list, width: int, desc: str) -> dict:
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"h": 8, "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + k), "datasource": DS, "expr": expr, "legendFormat": legend}
            for k, (expr, legend) in enumerate(targets)
        ],
    }


def _variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }


def dashboard() -> dict:
    panels, x, y = [], 0, 0
    for i, (title, unit, targets, width, desc) in enumerate(PANELS):
        if x + width > 24:
            x, y = 0, y + 8
        panels.append(_panel(i, x, y, title, unit, targets, width, desc))
        x += width
    return {
        "uid": "tandem-overview",
        "title": "Tandem",
        "description": "LLM model servers: idle fraction, cost per token, throughput, latency, queue, KV; "
        "the autoscaler's decisions.",
        "tags": ["tandem", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                _variable("namespace", "Namespace", "label_values(tandem_gpu_idle_fraction, namespace)"),
                _variable(
                    "pod", "Pod", 'label_values(tandem_gpu_idle_fraction{namespace=~"$namespace"}, pod)'
                ),
            ]
        },
        "panels": panels,
    }


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")


if __name__ == "__main__":
    main()
