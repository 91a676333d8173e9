"""The engine process: load the model, build and warm up the engine, then serve the fronts.

It shares no interpreter with the gRPC fronts or the metrics endpoint. Requests, aborts and load
queries arrive on one socket from every front; each step's new tokens go back as one message per
front that has requests in the step, and a report of the step (timings, tokens, load) goes to the
supervisor. When no step runs the engine waits on its socket, reporting its load every so often.
"""

from __future__ import annotations

import heapq
import logging
import signal
import time
from pathlib import Path

import torch
import zmq

from .. import contract as c
from ..cache_dirs import COMPILE_CACHE_UNUSABLE_EXIT, set_aside
from ..engine.engine_core import EngineCore
from ..engine.factory import build_engine, configure_threads, resolve_device
from ..engine.gc_pauses import GcPauses, freeze_start_up_heap
from ..engine.ops.fp8_linear import compute_dtype, quantization_of
from ..ipc import sockets
from ..models.loader import LoadedModel, load_model
from ..settings import ServerSettings
from ..telemetry.startup import StartupClock
from .child import exit_now, init_child

log = logging.getLogger("tandem.engine")
IDLE_REPORT_S = 0.5  # an idle engine still reports its load (and that it lives) this often


def warm_up(core: EngineCore, limits: c.Limits) -> None:
    """One short generation, so the first request does not pay for lazy initialisation."""
    prompt = [0] * min(8, limits.max_model_len - 2)
    core.add(c.Request("warm-up", prompt, c.SamplingParams(max_tokens=2, ignore_eos=True)))
    while core.has_work:
        core.run_once()


def _model_info(loaded: LoadedModel, device: str, core: EngineCore) -> c.ModelInfo:
    """What the engine serves, as built: its linear layers' and its KV cache's precision included."""
    model = loaded.model
    cache = core.runner.cache
    return c.ModelInfo(
        name=loaded.name,
        source=loaded.source,
        architecture=(model.config.architectures or [type(model).__name__])[0],
        dtype=str(compute_dtype(model)).removeprefix("torch."),
        device=device,
        eos_token_ids=sorted(loaded.eos_token_ids),
        tokenizer_path=str(loaded.path),
        quantization=quantization_of(model),
        kv_cache_dtype="fp8" if cache.quantized else str(cache.dtype).removeprefix("torch."),
    )


class EngineService:
    """The engine process's loop: commands in, one output message per step and front out."""

    def __init__(
        self,
        core: EngineCore,
        timings: list[c.StepTiming],
        max_waiting: int,
        inbox: zmq.Socket,
        fronts: list[zmq.Socket],
        supervisor: zmq.Socket,
        gc_pauses: GcPauses,
    ) -> None:
        self.core = core
        self.gc_pauses = gc_pauses
        self.timings = timings  # the core's step observer appends to it
        self.max_waiting = max_waiting
        self.inbox = inbox
        self.fronts = fronts
        self.supervisor = supervisor
        self.decoder = c.decoder(c.ToEngine)
        self.load_queries: list[c.LoadQuery] = []
        self.deadlines: list[tuple[float, str]] = []  # a heap of (wall clock, request id)
        self._reported = (core.generated_tokens, core.prompt_tokens)
        self._last_report = 0.0
        self._stopping = False

    def run(self) -> None:
        while not self._stopping:
            self._receive(block=not self.core.has_work)
            if self._stopping:
                break
            self._expire_waiting()
            outputs = self.core.run_once()
            self._bound_queue()
            self._report()  # before the tokens go out: a client that has them finds them counted
            for front, out in outputs.items():
                self._send(self.fronts[front], out)
        log.info("engine stopped")

    def _receive(self, block: bool) -> None:
        if block and not self.inbox.poll(IDLE_REPORT_S * 1000):
            self._report()
            return
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self.decoder.decode(frame))

    def _handle(self, msg: object) -> None:
        core = self.core
        if isinstance(msg, c.Request):
            if msg.deadline is not None:
                heapq.heappush(self.deadlines, (msg.deadline, msg.request_id))
            try:
                core.add(msg)
            except c.RequestError as exc:  # a constraint the front passed but the tokenizer refuses
                failed = c.StepOutputs(failed=[(msg.request_id, exc.kind, exc.message)])
                self._send(self.fronts[msg.front], failed)
        elif isinstance(msg, c.Abort):
            for request_id in msg.request_ids:
                core.abort(request_id)
        elif isinstance(msg, c.LoadQuery):
            self.load_queries.append(msg)  # answered after the step and the queue bound
        elif isinstance(msg, c.Shutdown):
            self._stopping = True

    def _bound_queue(self) -> None:
        """Refuse the newest requests that wait past `max_waiting` once the step has taken what it can.

        Here, the one place that sees every front's requests. A request that has run before (it was
        preempted) keeps its place."""
        waiting = self.core.scheduler.waiting
        excess = len(waiting) - self.max_waiting
        if excess <= 0:
            return
        refused = [seq.request_id for seq in reversed(waiting) if seq.num_preemptions == 0][:excess]
        self._refuse(refused, c.ErrorKind.RESOURCE_EXHAUSTED, "the request queue is full; retry later")

    def _expire_waiting(self) -> None:
        """Requests whose deadline passed while they waited never start (a running one is ended by
        its front, which keeps the same deadline)."""
        now, heap = time.time(), self.deadlines
        if not heap or heap[0][0] > now:
            return
        never_ran = {s.request_id for s in self.core.scheduler.waiting if s.num_preemptions == 0}
        expired = []
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            if rid in never_ran:
                expired.append(rid)
        self._refuse(expired, c.ErrorKind.DEADLINE_EXCEEDED, "the request's deadline passed while it waited")

    def _refuse(self, request_ids: list[str], kind: c.ErrorKind, why: str) -> None:
        """End requests that have not started, with `kind`'s status, and tell their fronts."""
        by_front: c.Outputs = {}
        for rid in request_ids:
            seq = self.core.scheduler.abort(rid)
            if seq is not None:
                by_front.setdefault(seq.request.front, c.StepOutputs()).failed.append((rid, kind, why))
        for front, out in by_front.items():
            self._send(self.fronts[front], out)

    def report_load(self) -> None:
        """The engine's load and counters to the supervisor now, whether or not a step ran."""
        self._last_report = 0.0
        self._report()

    def _report(self) -> None:
        core = self.core
        if self.load_queries:
            stats = core.stats()
            for query in self.load_queries:
                self._send(self.fronts[query.front], c.LoadReply(query.query, stats))
            self.load_queries.clear()
        counted = (core.generated_tokens, core.prompt_tokens)
        now = time.monotonic()
        if not self.timings and counted == self._reported and now - self._last_report < IDLE_REPORT_S:
            return
        report = c.StepReport(
            self.timings[:],
            counted[0] - self._reported[0],
            counted[1] - self._reported[1],
            core.stats(),
            self.gc_pauses.totals(),
        )
        self.timings.clear()
        self._reported, self._last_report = counted, now
        self._send(self.supervisor, report)

    @staticmethod
    def _send(sock: zmq.Socket, msg: object) -> None:
        sock.send(c.encode(msg), copy=False)


def _start_up(
    settings: ServerSettings, device: torch.device, clock: StartupClock, timings: list[c.StepTiming]
) -> tuple[LoadedModel, EngineCore, c.Limits]:
    """The weights, the engine built around them and warmed up, each phase on `clock`."""
    with clock.phase("weights"):
        loaded = load_model(settings.model, settings.model_name, device, settings.dtype, settings.cache_dir)
    built = time.perf_counter()
    core, limits = build_engine(loaded, settings, step_observer=timings.append)
    built = time.perf_counter() - built
    for phase, seconds in core.start_up_seconds.items():
        clock.add(phase, seconds)
    clock.add("kv_cache", built - sum(core.start_up_seconds.values()))  # the rest of the build
    if settings.warmup:
        with clock.phase("warm_up"):
            warm_up(core, limits)
    # the KV offload pool was pinned beside the compile and the warm-up; no request waits behind it
    clock.add("kv_cache", core.wait_for_host_pool())
    return loaded, core, limits


def engine_main(
    settings: ServerSettings, endpoints: sockets.Endpoints, num_fronts: int, log_level: str,
    started_at: float | None = None, compile_cache: tuple[Path | None, str] | None = None,
) -> None:
    """The engine process's entry point (spawned by the supervisor). `started_at`: when the server
    process started (epoch seconds), the start of the start-up's first phase; `compile_cache`: where
    the compiler's artefacts are kept (cache_dirs.use_compile_cache), None when not asked to."""
    clock = StartupClock()
    if started_at is not None:
        clock.add("spawn", time.time() - started_at)
    init_child(log_level)
    ctx = zmq.Context()
    inbox = sockets.pull(ctx, endpoints.engine)
    fronts = [sockets.push(ctx, endpoints.front(i)) for i in range(num_fronts)]
    supervisor = sockets.push(ctx, endpoints.supervisor)
    t0 = time.perf_counter()
    if compile_cache is not None:
        kept, said = compile_cache
        (log.info if kept else log.warning)("%s", said)
    device = resolve_device(settings.device)
    log.info("%d CPU threads", configure_threads(settings, device))
    timings: list[c.StepTiming] = []
    try:
        loaded, core, limits = _start_up(settings, device, clock, timings)
    except Exception:
        kept = compile_cache[0] if compile_cache is not None else None
        if kept is None:
            raise
        # torch.compile crashes on some corrupt artefacts (a truncated generated module): the
        # supervisor starts the engine once more, with none (a real fault fails again, and says so)
        log.exception("the start-up failed (with compiled artefacts from %s)", kept)
        aside = set_aside(kept)
        log.warning("compiled artefacts set aside at %s; starting again without them",
                    aside or "(none: the directory could not be moved)")
        exit_now(COMPILE_CACHE_UNUSABLE_EXIT)
    timings.clear()  # the warm-up is not traffic
    core.reset_counters()
    frozen = freeze_start_up_heap()
    log.info("%d objects of the start-up frozen out of the garbage collector's walks", frozen)
    # serving: the supervisor stops the engine (Shutdown) once the fronts have drained, and a SIGTERM
    # sent to the whole process group (a service manager, `timeout`) must not cut their streams short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready = c.EngineReady(_model_info(loaded, str(device), core), limits, dict(clock.seconds))
    with GcPauses(frozen) as gc_pauses:
        service = EngineService(
            core, timings, settings.max_waiting_requests, inbox, fronts, supervisor, gc_pauses
        )
        # its load goes to the supervisor ahead of EngineReady (one socket, in order): the pod's
        # engine gauges are there from the moment it serves
        service.report_load()
        for sock in (*fronts, supervisor):
            EngineService._send(sock, ready)
        log.info("model %r ready in %.1f s on %s (%s)", loaded.name, time.perf_counter() - t0, device,
                 clock.summary())
        service.run()
    for sock in (inbox, *fronts, supervisor):
        sock.close(linger=0)  # the fronts are gone: nothing left to deliver
    ctx.term()
    exit_now(0)
