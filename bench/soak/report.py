"""What `tandem bench soak` makes of its outcomes: status counts, what was unexpected, lost or
duplicated tokens, probe answers that differ, and the targets met or missed.

Pure functions of the plan (requests as dicts) and the outcomes (outcome.Outcome as dicts).
"""

from __future__ import annotations

from collections import Counter

from tandem.bench.common import percentile

# statuses of a request the soak cancelled itself that are its own doing
CANCEL_STATUS = {
    "chunks": {"CANCELLED"},
    "deadline": {"DEADLINE_EXCEEDED"},
    "timeout_param": {"DEADLINE_EXCEEDED"},
}
EXAMPLES = 5  # examples kept per kind of failure
DEADLINES = {"deadline", "timeout_param"}
# gRPC over HTTP/2 carries a deadline best effort: when the server's copy of the client's deadline fires
# first, its RST_STREAM can reach the client as INTERNAL with this message (grpc/grpc#2685)
TRANSPORT_DEADLINE = "Internal error from Core"


def status_of(o: dict) -> str:
    """The gRPC status, or ERROR_MESSAGE for a KServe stream that answered with an error response."""
    return "ERROR_MESSAGE" if o["status"] == "OK" and o["error_message"] else o["status"]


def unexpected(o: dict, r: dict) -> str | None:
    """Why an outcome is not what a healthy server gives (None: it is)."""
    status = status_of(o)
    if status == "OK":
        if o["kind"].startswith("native") and o["finish_reason"] in (None, "FINISH_REASON_CANCELLED"):
            if not o["cancelled"]:
                return f"OK without a finish reason ({o['finish_reason']})"
        return None
    if status in CANCEL_STATUS.get(r["cancel"], set()) and (r["cancel"] != "chunks" or o["cancelled"]):
        return None
    if status == "ERROR_MESSAGE" and r["cancel"] in DEADLINES and "deadline" in o["error_message"]:
        # on a KServe stream a request past its deadline (its `timeout`, or the call's deadline when the
        # server's copy of it fires first) gets an error response, and the stream goes on to its end
        return None
    if status == "INTERNAL" and r["cancel"] == "deadline" and o["error_message"] == TRANSPORT_DEADLINE:
        return None
    return f"{status}: {o['error_message'] or ''}"[:300]


def finished(o: dict) -> bool:
    """Ended on its own with an answer: what the token checks look at."""
    return status_of(o) == "OK" and not o["cancelled"]


def token_problems(o: dict, r: dict) -> list[str]:
    """What is wrong with the tokens of one finished request, on its own."""
    out = []
    if o["kind"].startswith("native"):
        if o["tokens"] != o["completion_tokens"]:
            out.append(f"received {o['tokens']} tokens, usage.completion_tokens {o['completion_tokens']}")
        if o["completion_tokens"] is not None and o["completion_tokens"] > r["max_tokens"]:
            out.append(f"{o['completion_tokens']} tokens past max_tokens {r['max_tokens']}")
        if o["finish_reason"] == "FINISH_REASON_LENGTH" and o["completion_tokens"] != r["max_tokens"]:
            out.append(f"LENGTH after {o['completion_tokens']} of max_tokens {r['max_tokens']}")
        if o["finish_reason"] == "FINISH_REASON_STOP" and r["ignore_eos"]:
            out.append("STOP although ignore_eos and no stop strings or ids")
    if o["prefix_ok"] is False:
        out.append("the output does not start with the prompt")
    if o["kind"] == "kserve_stream" and (
        not o["finals"] or o["finals"] != [False] * (len(o["finals"]) - 1) + [True]
    ):
        out.append(f"triton_final_response flags {o['finals'][-4:]} of {len(o['finals'])} (one true, last)")
    return out


def probe_mismatches(outcomes: list[dict], plan: dict[int, dict]) -> tuple[list[dict], dict]:
    """Finished probe answers that differ from their probe's most common answer (text; native token
    ids too), and per probe how many answers and distinct texts there were."""
    by_probe: dict[int, list[dict]] = {}
    for o in outcomes:
        p = plan[o["index"]]["probe"]
        if p is not None and finished(o) and o["text"] is not None:
            by_probe.setdefault(p, []).append(o)
    bad, summary = [], {}
    for p, group in sorted(by_probe.items()):
        texts = Counter(o["text"] for o in group)
        modal = texts.most_common(1)[0][0]
        ids = Counter(tuple(o["token_ids"]) for o in group if o["token_ids"] is not None)
        modal_ids = ids.most_common(1)[0][0] if ids else None
        r = plan[group[0]["index"]]
        summary[str(p)] = {
            "temperature": r["temperature"],
            "seed": r["seed"],
            "answers": len(group),
            "kinds": dict(Counter(o["kind"] for o in group)),
            "distinct_texts": len(texts),
        }
        for o in group:
            ids_differ = o["token_ids"] is not None and tuple(o["token_ids"]) != modal_ids
            if o["text"] != modal or ids_differ:
                bad.append(
                    {"index": o["index"], "kind": o["kind"], "probe": p, **_divergence(modal, o["text"])}
                )
    return bad, summary


def _divergence(a: str, b: str) -> dict:
    """Where two answers part, and whether one is the other with a piece cut out or repeated (what a
    lost or duplicated token looks like) rather than another continuation."""
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    rest_a, rest_b = a[i:], b[i:]
    spliced = bool(rest_a or rest_b) and (rest_a.endswith(rest_b) or rest_b.endswith(rest_a))
    return {
        "common_prefix_chars": i,
        "lengths": [len(a), len(b)],
        "piece_missing_or_repeated": spliced,
        "expected": a[max(0, i - 20) : i + 40],
        "got": b[max(0, i - 20) : i + 40],
    }


def check(plan: list[dict], outcomes: list[dict]) -> dict:
    """Statuses, unexpected ones, and the token checks of one pass."""
    by_index = {r["index"]: r for r in plan}
    statuses: dict[str, Counter] = {}
    bad_status, bad_tokens = [], []
    cancelled = Counter()
    for o in outcomes:
        r = by_index[o["index"]]
        statuses.setdefault(o["kind"], Counter())[status_of(o)] += 1
        if o["cancelled"] or (r["cancel"] and status_of(o) != "OK"):
            cancelled[o["kind"]] += 1
        why = unexpected(o, r)
        if why:
            bad_status.append({"index": o["index"], "kind": o["kind"], "cancel": r["cancel"], "why": why})
        elif finished(o):
            problems = token_problems(o, r)
            if problems:
                bad_tokens.append({"index": o["index"], "kind": o["kind"], "problems": problems})
    mismatched, probes = probe_mismatches(outcomes, by_index)
    checked = sum(finished(o) for o in outcomes)
    return {
        "requests": len(plan),
        "outcomes": len(outcomes),
        "missing_outcomes": len(plan) - len(outcomes),
        "statuses": {k: dict(v) for k, v in sorted(statuses.items())},
        "cancelled_by_soak": dict(cancelled),
        "unexpected": {
            "count": len(bad_status),
            "examples": bad_status[:EXAMPLES],
            "by_status": dict(Counter(b["why"].split(":")[0] for b in bad_status)),
        },
        "tokens": {
            "finished_checked": checked,
            "lost_or_duplicated": len(bad_tokens),
            "examples": bad_tokens[:EXAMPLES],
            "probes": probes,
            "probe_answers_differing": len(mismatched),
            # one answer is the other with a piece cut out or repeated: lost or duplicated tokens
            "probe_answers_spliced": sum(m["piece_missing_or_repeated"] for m in mismatched),
            "probe_examples": mismatched[:EXAMPLES],
        },
    }


def latency_ms(values: list[float]) -> dict:
    out = {f"p{q}": round(1e3 * percentile(values, q), 2) for q in (50, 99)} if values else {}
    if values:
        out["max"] = round(1e3 * max(values), 2)
    return out


def targets(report: dict, strict_probes: bool) -> dict:
    """Each target: its value, the bound, met or not; the `correctness` ones decide the exit status.

    `strict_probes`: probe answers that merely continue differently count as a failure too. On CPU in
    float32 the same prompt gives the same tokens in any batch; on a GPU in bf16 the GEMMs of other
    batch shapes round differently, and a near tie between two tokens can go either way."""
    run = report["run"]
    blocks = report["kv_blocks"]["leaked"]
    rss = report["rss"]["growth_pct"]
    p99 = report["health"]["latency_ms"].get("p99")
    rows = {
        "unexpected_errors": (run["unexpected"]["count"] + run["missing_outcomes"], "== 0", True),
        "lost_or_duplicated_tokens": (
            run["tokens"]["lost_or_duplicated"] + run["tokens"]["probe_answers_spliced"],
            "== 0",
            True,
        ),
        "probe_answers_differing": (run["tokens"]["probe_answers_differing"], "== 0", strict_probes),
        "leaked_kv_blocks": (blocks, "== 0", True),
        "rss_growth_pct": (rss, "< 5", False),
        "health_p99_ms": (p99, "< 100", False),
    }
    big = report.get("big_prompts")
    if big is not None:
        invalid = big["statuses"].get("INVALID_ARGUMENT", 0)
        rows["big_prompts_not_invalid_argument"] = (sum(big["statuses"].values()) - invalid, "== 0", True)
        rows["health_p99_ms_during_big_prompts"] = (big["health"]["latency_ms"].get("p99"), "< 100", False)
    out = {}
    for name, (value, bound, correctness) in rows.items():
        met = value is not None and (value == 0 if bound == "== 0" else value < float(bound.split()[1]))
        out[name] = {"value": value, "target": bound, "met": met, "correctness": correctness}
    return out


def markdown(report: dict) -> str:
    """Where it ran, the targets, then the statuses per API kind."""
    e = report["environment"]
    where = e.get("gpu") or f"{e['cpu']} ({e['cpu_cores']} cores)"
    lines = [
        f"`{report['command']}`",
        "",
        f"{e['date']}, {where}, {report['what']} on {e['device']}, torch {e['torch']}, commit {e['commit']}.",
        "",
        "| target | value | bound | met | decides the exit status |",
        "|---|---|---|---|---|",
    ]
    for name, t in report["targets"].items():
        met, decides = "yes" if t["met"] else "**no**", "yes" if t["correctness"] else "no"
        lines.append(f"| {name} | {t['value']} | {t['target']} | {met} | {decides} |")
    h, tp = report["health"], report["throughput"]
    lines += [
        "",
        f"Health: {h['checks']} checks, {h['not_serving']} not SERVING, latency p50 / p99 / max "
        f"{h['latency_ms'].get('p50')} / {h['latency_ms'].get('p99')} / {h['latency_ms'].get('max')} ms. "
        f"RSS {report['rss']['after_warmup_mib']} -> {report['rss']['end_mib']} MiB "
        f"(peak {report['rss']['peak_mib']}). Throughput: {tp['requests_s']} requests/s, "
        f"{tp['tokens_s']} generated tokens/s over {tp['seconds']} s. Probe answers: "
        f"{report['run']['tokens']['probe_answers_differing']} differing, "
        f"{report['run']['tokens']['probe_answers_spliced']} with a piece missing or repeated. Server log: "
        f"{report['server_log_problems']['by_level'] or 'no'} errors or warnings, "
        f"{report['server_log_problems']['tracebacks']} tracebacks.",
    ]
    big = report.get("big_prompts")
    if big is not None:
        lat = big["health"]["latency_ms"]
        lines += [
            "",
            f"Big prompts: {big['senders']} senders of 4 MB to 64 KB texts for {big['seconds']:.0f} s: "
            f"{big['statuses']}; answer p50 by size in bytes {big['answer_ms_p50_by_bytes']} ms; health "
            f"meanwhile p50 / p99 / max {lat.get('p50')} / {lat.get('p99')} / {lat.get('max')} ms, "
            f"{big['health']['not_serving']} not SERVING.",
        ]
    lines += [
        "",
        "| API kind | " + " | ".join(STATUS_COLUMNS) + " | other |",
        "|---|" + "---|" * (len(STATUS_COLUMNS) + 1),
    ]
    for kind, counts in report["run"]["statuses"].items():
        other = {k: v for k, v in counts.items() if k not in STATUS_COLUMNS}
        cells = [str(counts.get(c, 0)) for c in STATUS_COLUMNS]
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {other or '-'} |")
    return "\n".join(lines)


STATUS_COLUMNS = ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "ERROR_MESSAGE")
