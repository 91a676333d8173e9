"""What crosses the pod's process boundaries: one msgpack frame per message, typed by msgspec.

    front      ──Submit / Abort / LoadQuery──▶  engine      (one PULL socket, every front PUSHes to it)
    engine     ──EngineReady / StepOutputs / LoadReply──▶  front k   (its own PULL socket)
    supervisor ──PodReady / EngineGone / StatisticsReply──▶ front k,  ──Shutdown──▶ engine
    engine     ──EngineReady / StepReport──▶  supervisor,
    front      ──FrontReady / RequestRecord / StatisticsQuery──▶  supervisor

The engine's own records (SamplingParams, EngineStats, StepTiming, GcTotals, Limits) travel as they
are: msgspec encodes and decodes dataclasses, so the engine needs no wire types of its own. A step's
outputs, the one message sent hundreds of times a second, travel in columns instead (`StepOutputs`).
Every message is array-like (fields by position, no names on the wire; msgspec decodes a union of
one kind only).
"""

from __future__ import annotations

from typing import Union

import msgspec

from ..engine.errors import ErrorKind
from ..engine.gc_pauses import GcTotals
from ..engine.outputs import EngineStats, TokenLogprob
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import FinishReason
from ..engine.timing import StepTiming
from ..engine.validation import Limits


class Submit(msgspec.Struct, tag=True, array_like=True):
    request_id: str  # the front's own id, unique in the pod (a client's id is only echoed)
    front: int  # which front's socket gets its outputs
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None = None  # wall clock; a request still waiting then never starts
    cache_scope: bytes = b""  # who may share its cached prefix blocks (server/cache_scope.py)


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class LoadQuery(msgspec.Struct, tag=True, array_like=True):
    front: int
    query: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class ModelInfo(msgspec.Struct):
    name: str
    source: str
    architecture: str
    dtype: str
    device: str
    eos_token_ids: list[int]
    tokenizer_path: str  # where the fronts load the model's tokenizer from


class EngineReady(msgspec.Struct, tag=True, array_like=True):
    model: ModelInfo
    limits: Limits


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """Every new token of one engine step for one front's requests, in columns: a step makes one
    token per request, and what only some rows have (the start of a request's first step, its end,
    logprobs) is listed by row, so a step of hundreds of requests is a few flat arrays."""

    request_ids: list[str]
    tokens: list[int]
    # (row, when its first step began, prompt tokens found in the prefix cache)
    started: list[tuple[int, float, int]] = msgspec.field(default_factory=list)
    # (row, why, the stop token id if one ended it)
    finished: list[tuple[int, FinishReason, int | None]] = msgspec.field(default_factory=list)
    logprobs: list[tuple[int, TokenLogprob]] = msgspec.field(default_factory=list)
    failed: list[tuple[str, ErrorKind, str]] = msgspec.field(default_factory=list)  # request id, status, why


class LoadReply(msgspec.Struct, tag=True, array_like=True):
    query: int
    stats: EngineStats


class EngineGone(msgspec.Struct, tag=True, array_like=True):
    reason: str


class FrontReady(msgspec.Struct, tag=True, array_like=True):
    """A front has the model's tokenizer and could serve."""

    front: int


class PodReady(msgspec.Struct, tag=True, array_like=True):
    """Every front is ready: health may turn SERVING (a probe reaches any one of them)."""


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


ToEngine = Union[Submit, Abort, LoadQuery, Shutdown]  # noqa: UP007 - msgspec takes the typing form
ToFront = Union[EngineReady, StepOutputs, LoadReply, EngineGone, PodReady, StatisticsReply]  # noqa: UP007
ToSupervisor = Union[EngineReady, StepReport, RequestRecord, FrontReady, StatisticsQuery]  # noqa: UP007

encoder = msgspec.msgpack.Encoder()
encode = encoder.encode


def decoder(kind: object) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)
