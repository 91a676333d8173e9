"""The engine core thread: admit, schedule, run a step, hand results back; repeat."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..telemetry.idle import IdleTracker
from ..telemetry.steps import StepTiming
from .model_runner import LaunchedStep, ModelRunner, StepResult
from .sampling_params import GenerationRequest
from .scheduler import Scheduler, SchedulerOutput
from .sequence import FinishReason, Sequence

log = logging.getLogger(__name__)


@dataclass
class TokenLogprob:
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SeqUpdate:
    """What one step did for one request, handed to the front."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_token: int | None = None
    error: str | None = None
    scheduled_at: float | None = None  # wall clock of the request's first step (telemetry)


@dataclass
class InFlight:
    """A launched step whose tokens the host has not seen yet."""

    out: SchedulerOutput
    step: LaunchedStep
    started: float
    scheduled: float = 0.0  # wall clock when its scheduling began (step observer)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float
    kv_blocks_total: int
    kv_blocks_free: int
    idle_fraction: float


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        on_updates: Callable[[list[SeqUpdate]], None],
        async_loop: bool = False,
        step_observer: Callable[[StepTiming], None] | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.on_updates = on_updates
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.steps = 0
        self.async_loop = async_loop  # prepare step N+1 while the device runs step N
        self._last_end = 0.0
        self.busy_seconds = 0.0  # device time of all steps so far (event-timed on CUDA's async loop)
        self.idle = IdleTracker()
        self.step_observer = step_observer  # called on the engine thread once per finished step
        self._observer_failed = False

    # -- called from any thread ----------------------------------------------------------------
    def add(self, request: GenerationRequest) -> None:
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        blocks = self.scheduler.blocks
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=blocks.usage,
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free,
            idle_fraction=self.idle.idle_fraction(),
        )

    @property
    def alive(self) -> bool:
        """False once the engine thread has stopped or died (the liveness probe reads this)."""
        return self._thread is None or self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        launched: InFlight | None = None
        while not self._stopping.is_set():
            self.drain_inbox(block=not self.scheduler.has_work and launched is None)
            if self.async_loop:
                updates, launched = self.step_ahead(launched)
            elif self.scheduler.has_work:
                updates = self.step()
            else:
                continue
            if updates:
                self.on_updates(updates)

    def drain_inbox(self, block: bool) -> None:
        """Admit queued requests and apply aborts (the thread does this before every step)."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self.scheduler.add(self._new_sequence(payload))
            elif kind == "abort":
                self.scheduler.abort(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _new_sequence(self, req: GenerationRequest) -> Sequence:
        p = req.params
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        return Sequence(
            request_id=req.request_id,
            token_ids=list(req.prompt_ids),
            prompt_len=len(req.prompt_ids),
            params=p,
            seed=p.seed if p.seed is not None else random.getrandbits(63),
            max_total_len=self.max_model_len,
            stop_ids=stop_ids,
        )

    def step(self) -> list[SeqUpdate]:
        """One synchronous step. Public so tests can drive the engine without the thread."""
        t0 = time.time()
        out = self.scheduler.schedule()
        if not out.chunks:
            return []
        self._mark_scheduled(out, t0)
        started = time.monotonic()
        try:
            step = self.runner.launch(out.chunks, None)
            result = self.runner.wait(step)
        except Exception as exc:  # a failed step fails its requests, not the server
            log.exception("engine step failed")
            return self._fail(out, f"engine step failed: {exc}")
        end = time.monotonic()
        busy = step.device_seconds()  # CUDA: from the compute stream's event timestamps
        self._count_step(end - started if busy is None else busy, end)
        self._observe(out, step, t0)
        return self._process(out, result)

    def step_ahead(self, launched: InFlight | None) -> tuple[list[SeqUpdate], InFlight | None]:
        """One turn of the asynchronous loop: schedule and launch step N+1, then finish step N.

        The scheduler treats tokens still in flight as known (carried over on the device), so the
        CPU prepares the next batch while the device computes; the host waits once per step, for
        the previous step's tokens. Public so tests can drive it without the thread.
        """
        nxt = None
        t0 = time.time()
        out = self.scheduler.schedule() if self.scheduler.has_work else None
        if out is not None and out.chunks:
            self._mark_scheduled(out, t0)
            try:
                nxt = InFlight(
                    out,
                    self.runner.launch(out.chunks, launched.step if launched else None),
                    time.monotonic(),
                    t0,
                )
            except Exception as exc:
                log.exception("engine step launch failed")
                return self._fail(out, f"engine step failed: {exc}"), launched
        updates: list[SeqUpdate] = []
        if launched is not None:
            try:
                result = self.runner.wait(launched.step)
            except Exception as exc:
                log.exception("engine step failed")
                return self._fail(launched.out, f"engine step failed: {exc}"), nxt
            end = time.monotonic()
            busy = launched.step.device_seconds()  # CUDA: from the stream's event timestamps
            if busy is None:
                busy = end - max(launched.started, self._last_end)
            self._count_step(busy, end)
            self._observe(launched.out, launched.step, launched.scheduled)
            updates = self._process(launched.out, result)
        return updates, nxt

    def _count_step(self, busy: float, end: float) -> None:
        """A finished step that kept the device busy for `busy` seconds up to `end`."""
        self.idle.record(end - busy, end)
        self.busy_seconds += busy
        self._last_end = end
        self.steps += 1

    @staticmethod
    def _mark_scheduled(out: SchedulerOutput, now: float) -> None:
        for chunk in out.chunks:
            if chunk.seq.scheduled_at is None:
                chunk.seq.scheduled_at = now

    def _observe(self, out: SchedulerOutput, step: LaunchedStep, scheduled: float) -> None:
        """prepare = scheduling + batch build (host clock); on CUDA h2d / compute / d2h come from
        the step's stream events, on CPU compute is the rest of the step on the host clock."""
        if self.step_observer is None:
            return
        try:
            built = step.prepare[1]
            if step.events is not None:
                stages = step.events.intervals()  # the step is done: no synchronisation here
            else:
                stages = {"compute": (built, time.time())}
            self.step_observer(
                StepTiming(
                    prepare=(scheduled, built),
                    **stages,
                    batch_size=len(out.chunks),
                    num_tokens=out.num_tokens,
                    slot=step.slot,
                    graph_bucket=step.graph_bucket,
                )
            )
        except Exception:  # telemetry must never take the engine down
            if not self._observer_failed:
                log.exception("step observer failed; later failures are not logged")
                self._observer_failed = True

    def _process(self, out: SchedulerOutput, result: StepResult) -> list[SeqUpdate]:
        sampled = dict(zip(result.sample_chunks, result.tokens, strict=True))
        updates = []
        finished_before = {id(c.seq) for c in out.chunks if c.seq.finished}
        self.scheduler.finish_step(out, sampled)
        for row, ci in enumerate(result.sample_chunks):
            seq = out.chunks[ci].seq
            if id(seq) in finished_before:  # cancelled, or done in the step before: extra token dropped
                continue
            lp = None
            if result.logprobs is not None and seq.params.logprobs:
                top = result.top[row][: seq.params.top_logprobs] if result.top else []
                lp = [TokenLogprob(result.logprobs[row], top)]
            update = SeqUpdate(seq.request_id, [sampled[ci]], lp, seq.finish_reason, seq.stop_token)
            update.scheduled_at = seq.scheduled_at
            updates.append(update)
        return updates

    def _fail(self, out: SchedulerOutput, message: str) -> list[SeqUpdate]:
        updates = []
        for chunk in out.chunks:
            if self.scheduler.abort(chunk.seq.request_id) is not None:
                updates.append(SeqUpdate(chunk.seq.request_id, [], error=message))
        return updates
