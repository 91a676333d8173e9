"""The contract between the pod's processes: every record that crosses a process boundary, and its
wire encoding (one msgpack frame per message, typed by msgspec). Importable without torch: the
fronts and the supervisor import this module and nothing of the engine's.

    front      ──Request / Abort / LoadQuery──▶  engine      (one PULL socket, every front PUSHes to it)
    engine     ──EngineReady / StepOutputs / LoadReply──▶  front k   (its own PULL socket)
    supervisor ──PodReady / EngineGone / StatisticsReply──▶ front k,  ──Shutdown──▶ engine
    engine     ──EngineReady / StepReport──▶  supervisor,
    front      ──FrontReady / RequestRecord / StatisticsQuery──▶  supervisor

A request is admitted in a front (server/context.py), which makes its `Request`; the engine keeps
that record as the request's (the `Sequence` it schedules holds it), and fills each step's
`StepOutputs` for each front directly. Every message is array-like (fields by position, no names on
the wire; msgspec decodes a union of one kind only); the plain records inside messages
(SamplingParams, Limits, EngineStats, StepTiming, ...) are dataclasses, which msgspec encodes as
they are.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Union

import msgspec

# -- errors ---------------------------------------------------------------------------------------


class ErrorKind(enum.Enum):
    """Why a request was refused or failed; each API maps it onto its own status."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"


class RequestError(Exception):
    """A request refused or failed. `param`: the request field it is about, where one is (OpenAI's
    `param`); `code`: a machine-readable reason finer than `kind` (OpenAI's `code`), where one is."""

    def __init__(
        self, kind: ErrorKind, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code


def invalid(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(ErrorKind.INVALID_ARGUMENT, message, param, code)


# -- a request ------------------------------------------------------------------------------------


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate (structured output): exactly one field is set.
    Any front fills it (OpenAI's `response_format`, vLLM's `structured_outputs`, tool choices, the
    native and KServe fields); the front checks it (structured_output.check) and the engine turns it
    into a grammar, compiled once per distinct record (its cache key)."""

    json_schema: str | None = None  # a JSON schema, serialized (compact)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF / xgrammar's dialect), rule `root` first

    @property
    def kind(self) -> str:
        """The one field that is set, by name."""
        fields = ("json_schema", "regex", "choice", "grammar")
        set_ = [name for name in fields if getattr(self, name) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise ValueError(f"a StructuredOutput sets exactly one field, this one sets {set_ or 'none'}")
        return set_[0]


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of generation: sampling, stopping, logprobs."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = the engine draws one
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # the prompt's own logprobs: each prompt token's after the one before, with this many top tokens
    # (None = none; computed only for requests that ask: their prompt is not looked up in the
    # prefix cache, and their prefill keeps every position's logits)
    prompt_logprobs: int | None = None
    # generation constrained to a grammar (None = free); ends when the grammar does (finish "stop")
    structured_output: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Limits:
    """What the served model and the engine allow a request (the fronts check requests against it)."""

    vocab_size: int
    max_model_len: int
    default_max_tokens: int
    max_stop_strings: int
    max_stop_string_chars: int


class Request(msgspec.Struct, tag=True, array_like=True):
    """An admitted request: made by a front's admission, sent as it is, kept by the engine."""

    request_id: str  # the front's own id, unique in the pod (a client's id is only echoed)
    prompt_ids: list[int]
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # who may share its cached prefix blocks: requests of the same scope only (b"" = every request
    # of the shared scope); made by the front (server/cache_scope.py), opaque to the engine
    cache_scope: bytes = b""
    front: int = 0  # which front's socket gets its outputs
    deadline: float | None = None  # wall clock; a request still waiting then never starts


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class LoadQuery(msgspec.Struct, tag=True, array_like=True):
    front: int
    query: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


# -- what the engine hands back -------------------------------------------------------------------


@dataclass
class TokenLogprob:
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # of the token in its distribution, 1 = likeliest (prompt logprobs only)


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """Every new token of one engine step for one front's requests, in columns: a step makes one
    token per request, and what only some rows have (the start of a request's first step, its end,
    logprobs) is listed by row, so a step of hundreds of requests is a few flat arrays. The engine
    core fills it as it hands each token to its sequence."""

    request_ids: list[str] = msgspec.field(default_factory=list)
    tokens: list[int] = msgspec.field(default_factory=list)
    # (row, when its first step began (wall clock), prompt tokens found in the prefix cache)
    started: list[tuple[int, float, int]] = msgspec.field(default_factory=list)
    # (row, why, the stop token id where one of the request's stop_token_ids ended it)
    finished: list[tuple[int, FinishReason, int | None]] = msgspec.field(default_factory=list)
    logprobs: list[tuple[int, TokenLogprob]] = msgspec.field(default_factory=list)
    # (row, the logprob of each prompt token after the first), with a request's first token, for
    # requests that asked (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[tuple[int, list[TokenLogprob]]] = msgspec.field(default_factory=list)
    failed: list[tuple[str, ErrorKind, str]] = msgspec.field(default_factory=list)  # request id, status, why


Outputs = dict[int, StepOutputs]  # one step's outputs by front


@dataclass(frozen=True)
class EngineStats:
    """The engine's load right now, and its counters since start (after the warm-up)."""

    running: int
    waiting: int
    kv_usage: float
    kv_blocks_total: int
    kv_blocks_free: int
    idle_fraction: float
    # prefix caching: prompt tokens looked up at admission, and those found cached (prefill skipped)
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # preemptions by what became of the K/V: copied to the host pool, or dropped (to be
    # recomputed); KV blocks copied to the pool and back, those not copied back because the
    # prefix cache still held them on the device, and those not copied out because a running
    # sequence shared them (kept); the share of the pool in use
    preemptions_offload: int = 0
    preemptions_recompute: int = 0
    kv_offload_blocks_out: int = 0
    kv_offload_blocks_in: int = 0
    kv_offload_blocks_reused: int = 0
    kv_offload_blocks_kept: int = 0
    kv_offload_usage: float = 0.0


class LoadReply(msgspec.Struct, tag=True, array_like=True):
    query: int
    stats: EngineStats


# -- the processes' lifecycle ---------------------------------------------------------------------


class ModelInfo(msgspec.Struct):
    name: str
    source: str
    architecture: str
    dtype: str
    device: str
    eos_token_ids: list[int]
    tokenizer_path: str  # where the fronts load the model's tokenizer from
    quantization: str = "none"  # what the linear layers run in: "fp8" (W8A8) or "none" (`dtype`)
    kv_cache_dtype: str = "auto"  # what the KV cache stores: "fp8", or the model's dtype by name


class EngineReady(msgspec.Struct, tag=True, array_like=True):
    model: ModelInfo
    limits: Limits
    # seconds of each start-up phase the engine process saw (telemetry/startup.py names them)
    startup: dict[str, float] = msgspec.field(default_factory=dict)


class EngineGone(msgspec.Struct, tag=True, array_like=True):
    reason: str


class FrontReady(msgspec.Struct, tag=True, array_like=True):
    """A front has the model's tokenizer and could serve."""

    front: int


class PodReady(msgspec.Struct, tag=True, array_like=True):
    """Every front is ready: health may turn SERVING (a probe reaches any one of them)."""


# -- telemetry ------------------------------------------------------------------------------------

STAGES = ("prepare", "h2d", "compute", "d2h")
Interval = tuple[float, float]  # (start, end), wall clock: time.time() seconds


@dataclass(frozen=True)
class StepTiming:
    """One finished engine step. A stage that did not run on its own (e.g. h2d on CPU) is None."""

    prepare: Interval | None = None  # CPU: scheduling and batch building
    h2d: Interval | None = None
    compute: Interval | None = None  # forward + sample
    d2h: Interval | None = None
    batch_size: int = 0  # sequences in the step
    num_tokens: int = 0  # tokens computed (prefill chunks + decodes)
    context_tokens: int = 0  # positions attended over all rows (the KV read)
    prefill_tokens: int = 0  # tokens computed in prefill chunks (the rest are decodes, one per row)
    slot: int | None = None  # input slot of the asynchronous loop
    graph_bucket: int | None = None  # CUDA-graph batch-size bucket replayed, None = eager

    def stages(self) -> Iterator[tuple[str, Interval]]:
        for name in STAGES:
            interval = getattr(self, name)
            if interval is not None:
                yield name, interval

    @property
    def bounds(self) -> Interval | None:
        intervals = [i for _, i in self.stages()]
        if not intervals:
            return None
        return min(s for s, _ in intervals), max(e for _, e in intervals)


GC_GENERATIONS = 3


@dataclass(frozen=True)
class GcTotals:
    """The engine process's garbage collections and the seconds they took, by generation (0, 1, 2),
    since the counting began; the objects frozen at start-up."""

    collections: tuple[int, ...] = (0,) * GC_GENERATIONS
    seconds: tuple[float, ...] = (0.0,) * GC_GENERATIONS
    frozen_objects: int = 0


class StepReport(msgspec.Struct, tag=True, array_like=True):
    """The engine's telemetry since its last report: finished steps, tokens, the load right now."""

    timings: list[StepTiming]
    generated_tokens: int
    prompt_tokens: int
    stats: EngineStats
    gc: GcTotals  # the engine process's garbage collections since it began serving


class RequestRecord(msgspec.Struct, tag=True, array_like=True):
    """One finished request as a front saw it: what the GenAI latency histograms record."""

    operation: str
    model: str
    duration: float
    time_to_first_token: float | None = None
    time_per_output_token: float | None = None
    error: str | None = None
    # Triton's statistics extension (telemetry/model_statistics.py): when it ended (wall clock), and
    # its time in the front's admission, the engine's queue, the engine, and the response's last part
    ended: float = 0.0
    compute_input: float | None = None
    queue: float | None = None
    compute_infer: float | None = None
    compute_output: float | None = None


class Duration(msgspec.Struct, array_like=True):
    """A count of requests and their time together, in nanoseconds (Triton's StatisticDuration)."""

    count: int = 0
    ns: int = 0


class ModelStats(msgspec.Struct, array_like=True):
    """One model's statistics since the pod started, every front's requests together."""

    name: str
    last_inference_ms: int = 0  # when its last request ended, milliseconds since the epoch
    inference_count: int = 0
    execution_count: int = 0
    success: Duration = msgspec.field(default_factory=Duration)
    fail: Duration = msgspec.field(default_factory=Duration)
    queue: Duration = msgspec.field(default_factory=Duration)
    compute_input: Duration = msgspec.field(default_factory=Duration)
    compute_infer: Duration = msgspec.field(default_factory=Duration)
    compute_output: Duration = msgspec.field(default_factory=Duration)


class StatisticsQuery(msgspec.Struct, tag=True, array_like=True):
    """A front asks the supervisor for the pod's model statistics (KServe ModelStatistics)."""

    front: int
    query: int


class StatisticsReply(msgspec.Struct, tag=True, array_like=True):
    query: int
    models: list[ModelStats]


# -- the wire -------------------------------------------------------------------------------------

ToEngine = Union[Request, Abort, LoadQuery, Shutdown]  # noqa: UP007 - msgspec takes the typing form
ToFront = Union[EngineReady, StepOutputs, LoadReply, EngineGone, PodReady, StatisticsReply]  # noqa: UP007
ToSupervisor = Union[EngineReady, StepReport, RequestRecord, FrontReady, StatisticsQuery]  # noqa: UP007

encoder = msgspec.msgpack.Encoder()
encode = encoder.encode


def decoder(kind: object) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)
