"""The engine core: admit, schedule, run a step, hand the step's new tokens back; repeat.

Driven by one thread (the engine process's loop, a benchmark, a test) that calls `add`, `abort` and
`run_once` in turn; nothing in it is shared with another thread. It takes each request as admission
made it (`contract.Request`) and fills each step's `contract.StepOutputs`, one per front, as it hands
the step's tokens to their sequences.

A constrained request whose grammar is not compiled yet waits outside the scheduler while the
compile thread builds it (grammar.py), and joins the queue on the first turn after.
A step with constrained rows (structured output: grammar.py) is launched as its forward alone; its
rows' token masks are filled on the host while the device runs that forward, after the step before
has been handed out (its tokens are the ones the masks follow), and only then is it sampled.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from ..contract import (
    EngineStats,
    ErrorKind,
    Outputs,
    Request,
    RequestError,
    StepOutputs,
    StepTiming,
    TokenLogprob,
    invalid,
)
from .config import EngineConfig
from .grammar import PENDING, Grammars
from .model_runner import LaunchedStep, ModelRunner
from .sampler import SampleOutput
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence
from .timing import IdleTracker

log = logging.getLogger(__name__)
MAX_FAILED_STEPS = 3  # a sequence in this many failed steps is failed, even if its lone steps pass
COMPILE_WAIT_S = 0.005  # an idle loop's wait for a grammar compile, between looks at its inbox


class EngineFailure(RuntimeError):
    """The device is unusable (a CUDA error poisons its context): the engine must stop."""


def _is_fatal(exc: BaseException) -> bool:
    text = str(exc)
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in text or "CUBLAS_STATUS" in text


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        config: EngineConfig,
        eos_token_ids: frozenset[int],
        step_observer: Callable[[StepTiming], None] | None = None,
    ) -> None:
        """`config`: resolved (core_builder.resolve), as the runner's."""
        assert config.resolved, "an EngineConfig reaches the core through core_builder.resolve"
        self.runner = runner
        self.scheduler = scheduler
        self.max_model_len = config.max_model_len
        self.eos_token_ids = eos_token_ids
        self.async_loop = config.step_loop == "async"  # prepare step N+1 while the device runs step N
        self.step_observer = step_observer  # called once per finished step
        self.steps = 0
        self._launched: LaunchedStep | None = None  # the asynchronous loop's step in flight
        self._last_end = 0.0
        self.busy_seconds = 0.0  # device time of all steps so far (event-timed on CUDA's async loop)
        self.idle = IdleTracker(config.telemetry_window_s)
        self.generated_tokens = 0  # handed back to requests (an extra token that is dropped is not)
        self.prompt_tokens = 0  # of requests that got their first token
        self._observer_failed = False
        # start-up seconds of its build: compiling each step shape, capturing the decode graphs
        self.start_up_seconds: dict[str, float] = {}
        # structured output's compiler and masks (the factory sets it: it needs the tokenizer)
        self.grammars: Grammars | None = None
        self._compiling: list[Sequence] = []  # in arrival order: their grammars are being compiled
        self._open_host_pool()  # a pool allocated before the core: open from the start

    def add(self, request: Request) -> None:
        """Queue a request (a constrained one whose grammar is not compiled yet waits for it)."""
        seq = self._new_sequence(request)
        constraint = request.params.structured_output
        if constraint is not None:
            if self.grammars is None:
                raise invalid("structured output needs the model's tokenizer, which this engine lacks")
            if not self.grammars.ready(constraint):
                self.grammars.compile_soon(constraint)
                if self._idle():  # no one to stall: its prompt's prefill overlaps the compile
                    seq.grammar = PENDING
                    self.scheduler.add(seq)
                else:
                    self._compiling.append(seq)
                return
            seq.grammar = self.grammars.state_for(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if it is not here (any more)."""
        for seq in self._compiling:
            if seq.request_id == request_id:
                self._compiling.remove(seq)
                return True
        return self.scheduler.abort(request_id) is not None

    def _admit_compiled(self) -> Outputs:
        """Requests whose grammars are compiled join the queue; one whose constraint the model's
        tokenizer refuses fails (INVALID_ARGUMENT), in the returned outputs. With nothing else to
        run, wait a little for a compile rather than spin."""
        if not self._compiling or self.grammars is None:
            return {}
        if not (self.scheduler.has_work or self.step_in_flight):
            self.grammars.wait_for_any(COMPILE_WAIT_S)
        outputs: Outputs = {}
        waiting = []
        for seq in self._compiling:
            if not self.grammars.done(seq.params.structured_output):
                waiting.append(seq)
                continue
            try:
                seq.grammar = self.grammars.state_for(seq)
            except RequestError as exc:
                failed = outputs.setdefault(seq.request.front, StepOutputs()).failed
                failed.append((seq.request_id, exc.kind, exc.message))
                continue
            self.scheduler.add(seq)
        self._compiling = waiting
        return outputs

    def _idle(self) -> bool:
        return not (self.scheduler.has_work or self.step_in_flight or self._compiling)

    @property
    def step_in_flight(self) -> bool:
        """The asynchronous loop has launched a step whose tokens the host has not seen yet."""
        return self._launched is not None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.step_in_flight or bool(self._compiling)

    def run_once(self) -> Outputs:
        """One turn of the configured step loop; the outputs of the step that finished in it, by front
        (and the requests whose constraints failed to compile)."""
        refused = self._admit_compiled()
        if self.async_loop:
            outputs, self._launched = self.step_ahead(self._launched)
        else:
            outputs = self.step() if self.scheduler.has_work else {}
        for front, out in refused.items():
            outputs.setdefault(front, StepOutputs()).failed.extend(out.failed)
        return outputs

    def stats(self) -> EngineStats:
        blocks = self.scheduler.blocks
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self.scheduler.suspects) + len(self._compiling),
            kv_usage=blocks.usage,
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free,
            idle_fraction=self.idle.idle_fraction(),
            prefix_cache_queried_tokens=blocks.queried_tokens,
            prefix_cache_hit_tokens=blocks.hit_tokens,
            preemptions_offload=self.scheduler.preempted_offload,
            preemptions_recompute=self.scheduler.preempted_recompute,
            kv_offload_blocks_out=self.scheduler.blocks_offloaded,
            kv_offload_blocks_in=self.scheduler.blocks_restored,
            kv_offload_blocks_reused=self.scheduler.blocks_reused,
            kv_offload_blocks_kept=self.scheduler.blocks_kept,
            kv_offload_usage=self.scheduler.host.usage if self.scheduler.host is not None else 0.0,
        )

    def reset_counters(self) -> None:
        """Start counting tokens afresh (after a warm-up, which is not traffic)."""
        self.generated_tokens = self.prompt_tokens = 0
        self.scheduler.blocks.queried_tokens = self.scheduler.blocks.hit_tokens = 0
        s = self.scheduler
        s.preempted_offload = s.preempted_recompute = s.blocks_offloaded = s.blocks_restored = 0
        s.blocks_reused = s.blocks_kept = 0

    def _new_sequence(self, request: Request) -> Sequence:
        p = request.params
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        return Sequence(
            request=request,
            token_ids=list(request.prompt_ids),
            prompt_len=len(request.prompt_ids),
            seed=p.seed if p.seed is not None else random.getrandbits(63),
            max_total_len=self.max_model_len,
            stop_ids=stop_ids,
        )

    def step(self) -> Outputs:
        """One synchronous step."""
        t0 = time.time()
        out = self._schedule()
        if not out.chunks:
            return {}
        self._mark_scheduled(out, t0)
        refused: Outputs = {}
        try:
            step = self.runner.launch(out, None, t0, self._constrained(out))
            if step.unsampled is not None:
                self._sample_masked(step, refused)
            result = self.runner.wait(step)
        except Exception as exc:  # a failed step fails the request that caused it, not the server
            return _merge(self._contain([out], exc, {}), refused)
        return _merge(self._complete(step, result), refused)

    def step_ahead(self, launched: LaunchedStep | None) -> tuple[Outputs, LaunchedStep | None]:
        """One turn of the asynchronous loop: schedule and launch step N+1, then finish step N.

        The scheduler treats tokens still in flight as known (carried over on the device), so the
        CPU prepares the next batch while the device computes; the host waits once per step, for
        the previous step's tokens.
        """
        nxt = None
        refused: Outputs = {}  # requests whose grammars the model's tokenizer refused (_resolve)
        t0 = time.time()
        out = self._schedule() if self.scheduler.has_work else None
        if out is not None and out.chunks:
            self._mark_scheduled(out, t0)
            try:
                nxt = self.runner.launch(out, launched, t0, self._constrained(out))
                if nxt.unsampled is not None and launched is None:  # no step before it to hand out
                    self._sample_masked(nxt, refused)
            except Exception as exc:  # step N is sound unless its wait fails too: finish it first
                failed, outputs = [out], {}
                if launched is not None:
                    try:
                        result = self.runner.wait(launched)
                    except Exception:
                        failed.insert(0, launched.out)
                    else:
                        outputs = self._complete(launched, result)
                return _merge(self._contain(failed, exc, outputs), refused), None
        if launched is None:
            return refused, nxt
        try:
            result = self.runner.wait(launched)
        except Exception as exc:  # step N+1 was built on step N's tokens: it goes too
            failed = [launched.out]
            if nxt is not None:
                self._settle(nxt)
                failed.append(nxt.out)
            return self._contain(failed, exc, {}), None
        outputs = self._complete(launched, result)
        if nxt is not None and nxt.unsampled is not None:
            # step N's tokens are in their matchers: step N+1's masks, while the device runs its forward
            try:
                self._sample_masked(nxt, outputs)
            except Exception as exc:
                self._settle(nxt)
                return self._contain([nxt.out], exc, outputs), None
        return outputs, nxt

    def _constrained(self, out: SchedulerOutput) -> bool:
        """Some row the step samples has a grammar (its sampling waits for the masks)."""
        return self.grammars is not None and any(c.samples and c.seq.grammar is not None for c in out.chunks)

    def _sample_masked(self, step: LaunchedStep, refused: Outputs) -> None:
        """Fill a constrained step's token masks on the host, then queue its sampling. A request the
        model's tokenizer refuses a grammar for joins `refused`."""
        seqs = [step.out.chunks[ci].seq for ci in step.batch.sample_chunks]
        for seq in seqs:
            if seq.grammar is PENDING:
                self._resolve(seq, refused)
        self.runner.sample_masked(step, self.grammars.fill(seqs, step.slot))

    def _resolve(self, seq: Sequence, refused: Outputs) -> None:
        """The grammar of a sequence scheduled while it compiled, waited for now (the compile's rest).
        One the model's tokenizer refuses ends its request with INVALID_ARGUMENT; its row is sampled
        unmasked and dropped, as a cancelled request's."""
        if seq.finished:
            seq.grammar = None
            return
        try:
            seq.grammar = self.grammars.state_for(seq)
        except RequestError as exc:
            seq.grammar = None
            if self.scheduler.abort(seq.request_id) is not None:
                failed = refused.setdefault(seq.request.front, StepOutputs()).failed
                failed.append((seq.request_id, exc.kind, exc.message))

    def _schedule(self) -> SchedulerOutput:
        """The next step, its K/V copies to and from the host pool already queued (they come
        before its forward, and are queued even if the step has nothing to compute)."""
        self._open_host_pool()
        out = self.scheduler.schedule()
        if out.moves:
            self.runner.move_blocks(out.moves)
        return out

    def wait_for_host_pool(self) -> float:
        """Wait until a host pool allocated in the background is there (pinning it holds the CUDA
        driver: a step launched meanwhile would wait behind it), and open it. -> seconds waited."""
        start = time.perf_counter()
        if self.runner.offload is not None:
            self.runner.offload.wait()
        self._open_host_pool()
        return time.perf_counter() - start

    def _open_host_pool(self) -> None:
        """Open the scheduler's host pool once its memory exists (kv_offload.py: allocated on a thread
        of its own in the server; never, where it could not be had)."""
        host, offload = self.scheduler.host, self.runner.offload
        if host is not None and not host.is_open and offload is not None and offload.ready:
            host.open()

    def _complete(self, step: LaunchedStep, result: SampleOutput[list]) -> Outputs:
        """Both loops' tail: count the step's busy time, report its timing, hand out its tokens."""
        end = time.monotonic()
        busy = step.device_seconds()  # CUDA: from the stream's event timestamps
        if busy is None:
            busy = end - max(step.launched, self._last_end)
        self._count_step(busy, end)
        self._observe(step)
        return self._process(step, result)

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

    def _observe(self, step: LaunchedStep) -> None:
        """prepare = scheduling + batch build (host clock); on CUDA h2d / compute / d2h come from
        the step's stream events, on CPU compute is the rest of the step on the host clock."""
        if self.step_observer is None:
            return
        out = step.out
        try:
            built = step.prepare[1]
            if step.events is not None:
                stages = step.events.intervals()  # the step is done: no synchronisation here
            else:
                stages = {"compute": (built, time.time())}
            self.step_observer(
                StepTiming(
                    prepare=(step.scheduled, built),
                    **stages,
                    batch_size=len(out.chunks),
                    num_tokens=out.num_tokens,
                    context_tokens=sum(c.start + c.num_tokens for c in out.chunks),
                    prefill_tokens=sum(c.num_tokens for c in out.chunks if c.num_tokens > 1),
                    slot=step.slot,
                    graph_bucket=step.graph_bucket,
                )
            )
        except Exception:  # telemetry must never take the engine down
            if not self._observer_failed:
                log.exception("step observer failed; later failures are not logged")
                self._observer_failed = True

    def _process(self, step: LaunchedStep, result: SampleOutput[list]) -> Outputs:
        """Hand the step's tokens to their sequences, and fill each front's outputs with those that
        took one (`result`'s rows are the step's chunks `step.batch.sample_chunks`)."""
        out, sample_chunks = step.out, step.batch.sample_chunks
        if result.prompt is not None:
            _collect_prompt_logprobs(step, result)
        sampled = dict(zip(sample_chunks, result.tokens, strict=True))
        took = self.scheduler.finish_step(out, sampled)
        rows = {ci: row for row, ci in enumerate(sample_chunks)} if result.logprobs is not None else {}
        outputs: Outputs = {}
        for ci in took:
            seq = out.chunks[ci].seq
            front = seq.request.front
            o = outputs.get(front)
            if o is None:
                o = outputs[front] = StepOutputs()
            row = len(o.request_ids)
            o.request_ids.append(seq.request_id)
            o.tokens.append(sampled[ci])
            if seq.num_output == 1:
                self.prompt_tokens += seq.prompt_len
                o.started.append((row, seq.scheduled_at, seq.cached_tokens or 0))
                if seq.params.prompt_logprobs is not None:
                    o.prompt_logprobs.append((row, seq.prompt_logprobs))
            if rows and seq.params.logprobs:
                o.logprobs.append((row, _logprob(result, rows[ci], seq.params.top_logprobs)))
            if seq.finish_reason is not None:
                o.finished.append((row, seq.finish_reason, seq.stop_token))
        self.generated_tokens += len(took)
        return outputs

    def _settle(self, step: LaunchedStep) -> None:
        """Wait for a launched step whose tokens are void, whatever it ends with."""
        try:
            self.runner.wait(step)
        except Exception as exc:
            log.debug("a step discarded after a failure failed as well: %s", exc)

    def _contain(self, failed: list[SchedulerOutput], exc: Exception, outputs: Outputs) -> Outputs:
        """A step failed and nothing is in flight any more. A step of one sequence fails it; a batch
        is quarantined, each sequence recomputed alone, so that only the culprit fails. The failed
        requests join `outputs` (those of a step that went through first), which is returned."""
        if _is_fatal(exc):
            raise EngineFailure(f"the device failed: {exc}") from exc
        seqs = list({id(c.seq): c.seq for out in failed for c in out.chunks if not c.seq.finished}.values())
        for seq in seqs:
            seq.num_failed_steps += 1
        alone = len(seqs) == 1
        culprits = [s for s in seqs if alone or s.num_failed_steps >= MAX_FAILED_STEPS]
        if alone:
            log.exception("engine step failed; failing its one request %s", seqs[0].request_id)
        else:
            log.exception("engine step of %d requests failed; running each alone to find why", len(seqs))
        for seq in culprits:
            if self.scheduler.abort(seq.request_id) is not None:
                o = outputs.setdefault(seq.request.front, StepOutputs())
                o.failed.append((seq.request_id, ErrorKind.INTERNAL, f"engine step failed: {exc}"))
        self.scheduler.quarantine([s for s in seqs if s not in culprits])
        return outputs


def _merge(outputs: Outputs, refused: Outputs) -> Outputs:
    """`outputs` with the failures of `refused` added (for each front)."""
    for front, extra in refused.items():
        outputs.setdefault(front, StepOutputs()).failed.extend(extra.failed)
    return outputs


def _top_pairs(
    top_ids: list | None, top_logprobs: list | None, row: int, top: int
) -> list[tuple[int, float]]:
    """Row `row`'s `top` most likely (token, logprob) pairs; none where no top tokens were taken."""
    if top_ids is None or top_logprobs is None or not top:
        return []
    return list(zip(top_ids[row][:top], top_logprobs[row][:top], strict=True))


def _logprob(result: SampleOutput[list], row: int, top: int) -> TokenLogprob:
    """Row `row`'s logprob, with the `top` most likely tokens' (the step sampled at least that many)."""
    return TokenLogprob(result.logprobs[row], _top_pairs(result.top_ids, result.top_logprobs, row, top))


def _collect_prompt_logprobs(step: LaunchedStep, result: SampleOutput[list]) -> None:
    """Hand each prompt row's logprob to its sequence (rows of a chunk: consecutive positions, after
    those of its steps before)."""
    prompt, rows = result.prompt, step.batch.prompt
    row = 0
    for ci, count in rows.chunks:
        seq = step.out.chunks[ci].seq
        top = seq.params.prompt_logprobs or 0
        for r in range(row, row + count):
            pairs = _top_pairs(prompt.top_ids, prompt.top_logprobs, r, top)
            seq.prompt_logprobs.append(TokenLogprob(prompt.logprobs[r], pairs, prompt.ranks[r]))
        row += count
