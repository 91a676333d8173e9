"""What `tandem bench soak` watches on the server besides the answers: its health latency (a prober
process of its own), the memory of its processes, its KV blocks once idle, and its token counter.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.bench.soak.report import latency_ms
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

# -- memory: the server's process tree -----------------------------------------------------------


def _ppids() -> dict[int, int]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended meanwhile
            continue
        # the name in parentheses may hold spaces; the fields after it do not
        out[int(stat.parent.name)] = int(text.rsplit(")", 1)[1].split()[1])
    return out


def tree(root: int) -> list[int]:
    """`root` and every process below it: `tandem serve`'s supervisor, engine, fronts and helpers."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _ppids().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return sorted(out)


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None  # a zombie has no VmRSS


def _cmdline(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in args if a)[:80]


def server_roles(log: Path, root: int) -> dict[int, str]:
    """pid -> supervisor / engine / front-N, from the line the supervisor logs when it starts them."""
    roles = {root: "supervisor"}
    found = re.search(r"engine process (\d+), front process\(es\) ([\d, ]+) on port", log.read_text())
    if found:
        roles[int(found[1])] = "engine"
        for i, pid in enumerate(found[2].split(",")):
            roles[int(pid)] = f"front-{i}"
    return roles


def tree_rss(root: int, roles: dict[int, str] | None = None) -> dict:
    """The sum of VmRSS (MiB) over the server's own processes (named by `roles`; all when None), and
    each process's, helpers included by their command. Helpers come and go (on CUDA, torch.compile's
    worker processes stay from the warm-up and leave later): they are listed, not counted."""
    procs, total = [], 0.0
    for pid in tree(root):
        kib = _rss_kib(pid)
        if kib is not None:
            cmdline = _cmdline(pid)
            role = (roles or {}).get(pid)
            name = role or ("resource_tracker" if "resource_tracker" in cmdline else cmdline)
            procs.append({"pid": pid, "process": name, "rss_mib": round(kib / 1024, 1)})
            if roles is None or role is not None:
                total += kib / 1024
    return {"total_mib": round(total, 1), "processes": procs}


class RssSampler:
    """The tree's total RSS every `period` seconds while a run goes, for its peak and its course."""

    def __init__(self, root: int, roles: dict[int, str] | None = None, period: float = 1.0) -> None:
        self.root, self.roles, self.period = root, roles, period
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.period):
            self.samples.append(
                (round(time.monotonic() - t0, 1), tree_rss(self.root, self.roles)["total_mib"])
            )

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _growth(before: float, after: float) -> float:
    return round(100 * (after / before - 1), 2)


def rss_report(warm: dict, end: dict, samples: list[tuple[float, float]]) -> dict:
    """Memory after the warm-up and at the end (both idle), its growth, and the run's peak."""
    return {
        "after_warmup_mib": warm["total_mib"],
        "end_mib": end["total_mib"],
        "growth_pct": _growth(warm["total_mib"], end["total_mib"]),
        "peak_mib": max([s for _, s in samples] + [end["total_mib"]]),
        # a leak per request shows in the front long before it shows in a total the KV cache dominates
        "growth_pct_by_process": {
            p["process"]: _growth(p["rss_mib"], e["rss_mib"])
            for p in warm["processes"]
            for e in end["processes"]
            if p["pid"] == e["pid"]
        },
        "processes_after_warmup": warm["processes"],
        "processes_end": end["processes"],
        "samples": samples,
    }


# -- health: a prober process --------------------------------------------------------------------


def run_prober(address: str, interval_s: float, ready: object, stop: object, out: object) -> None:
    """Process entry point: grpc.health.v1 Check every `interval_s` until `stop` is set; puts
    [(seconds since the first check, latency in seconds, status name)] on `out`."""
    samples: list[tuple[float, float, str]] = []
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        ready.set()
        t0 = next_at = time.perf_counter()
        while not stop.is_set():
            start = time.perf_counter()
            try:
                reply = stub.Check(request, timeout=10)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as err:
                status = err.code().name
            samples.append((round(start - t0, 4), time.perf_counter() - start, status))
            next_at += interval_s
            # a slow answer does not make the prober ask in a burst to catch up
            next_at = max(next_at, time.perf_counter())
            stop.wait(next_at - time.perf_counter())
    out.put(samples)


class Prober:
    """The health prober process, for the length of a `with`."""

    def __init__(self, address: str, interval_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready, self.stop, self.out = ctx.Event(), ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(
            target=run_prober, args=(address, interval_s, self.ready, self.stop, self.out)
        )
        self.samples: list[tuple[float, float, str]] = []

    def __enter__(self) -> Prober:
        self.proc.start()
        if not self.ready.wait(120):
            raise RuntimeError("the health prober did not connect")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.samples = self.out.get(timeout=60)
        self.proc.join(timeout=30)

    def summary(self, interval_s: float) -> dict:
        latencies = [lat for _, lat, _ in self.samples]
        statuses = dict(Counter(s for _, _, s in self.samples))
        gaps = [b[0] - a[0] for a, b in zip(self.samples, self.samples[1:], strict=False)]
        worst = sorted(self.samples, key=lambda x: -x[1])[:5]
        return {
            "interval_ms": round(1e3 * interval_s),
            "slowest": [{"at_s": t, "ms": round(1e3 * lat, 1), "status": st} for t, lat, st in worst],
            "checks": len(self.samples),
            "statuses": statuses,
            "not_serving": len(self.samples) - statuses.get("SERVING", 0),
            "latency_ms": latency_ms(latencies),
            "longest_gap_ms": round(1e3 * max(gaps), 1) if gaps else None,
        }


# -- the engine once idle ------------------------------------------------------------------------


def wait_idle(address: str, timeout_s: float = 60.0, period: float = 0.2) -> dict:
    """GetLoad until nothing runs or waits and every KV block is free (cancelled requests free theirs
    a step later), or `timeout_s`; the last reading, and how long it took."""
    start = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TandemStub(channel)
        while True:
            try:
                load = stub.GetLoad(pb.LoadRequest(), timeout=10)
            except grpc.RpcError as err:  # a server that hangs or died: no reading, the target fails
                return {"source": "tandem.v1.Tandem/GetLoad", "error": err.code().name, "leaked": None}
            idle = load.requests_running == 0 and load.requests_waiting == 0
            waited = time.monotonic() - start
            if (idle and load.kv_blocks_free == load.kv_blocks_total) or waited > timeout_s:
                break
            time.sleep(period)
    return {
        "source": "tandem.v1.Tandem/GetLoad",
        "kv_blocks_total": load.kv_blocks_total,
        "kv_blocks_free": load.kv_blocks_free,
        "leaked": load.kv_blocks_total - load.kv_blocks_free,
        "requests_running": load.requests_running,
        "requests_waiting": load.requests_waiting,
        "waited_s": round(waited, 2),
    }


def log_problems(log: Path, examples: int = 3) -> dict:
    """ERROR and WARNING lines and tracebacks in the server's log: a healthy server under load that
    only sees its clients cancel should write none."""
    levels: Counter = Counter()
    first: dict[str, str] = {}
    tracebacks = 0
    for line in log.read_text(errors="replace").splitlines():
        tracebacks += line.startswith("Traceback")
        found = re.match(r"\S+ \S+ (ERROR|WARNING|CRITICAL) (.*)", line)
        if found:
            levels[found[1]] += 1
            if len(first) < examples:
                first.setdefault(found[2][:200], found[1])
    return {"by_level": dict(levels), "tracebacks": tracebacks, "examples": list(first)}


def metric(url: str, name: str) -> float | None:
    """One sample's value from the server's /metrics (the first sample of that family)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None
