"""KServe v2 / Open Inference Protocol (`inference.GRPCInferenceService`) with Triton's LLM tensors.

Inputs: text_input (BYTES, a raw prompt, no chat template), max_tokens (INT32), stream (BOOL),
sampling_parameters (BYTES, JSON: temperature, top_p, top_k, seed, stop, max_tokens, and structured
output as the OpenAI front reads it: response_format, structured_outputs, guided_json, guided_regex,
guided_choice, guided_grammar),
exclude_input_in_output (BOOL). Request parameters: timeout (Triton's, microseconds) and
cache_salt (a string: shares cached prompt prefixes only with requests of the same salt).
Output: text_output (BYTES). ModelStreamInfer is decoupled: one response per chunk, the last one
with the parameter triton_final_response=true.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from tandem import __version__
from tandem.kserve import grpc_service_pb2 as pb
from tandem.kserve import grpc_service_pb2_grpc as pb_grpc
from tandem.kserve import model_config_pb2 as mc

from .. import contract as c
from ..contract import ErrorKind, RequestError, invalid
from ..telemetry.requests import RequestTelemetry
from . import structured_fields
from .context import ContextHolder, Delivery, ModelContext, whole_answer
from .errors import abort, abort_if_too_large
from .kserve_tensors import bytes_output, read_inputs
from .request_stream import GenerationChunk
from .servicer import Servicer

INPUTS = (  # name, KServe datatype, model-config type, optional
    ("text_input", "BYTES", mc.TYPE_STRING, False),
    ("max_tokens", "INT32", mc.TYPE_INT32, True),
    ("stream", "BOOL", mc.TYPE_BOOL, True),
    ("sampling_parameters", "BYTES", mc.TYPE_STRING, True),
    ("exclude_input_in_output", "BOOL", mc.TYPE_BOOL, True),
)
# what each input may be sent as: its own datatype, and for max_tokens any integer
ACCEPTED = {name: {dt} for name, dt, _, _ in INPUTS} | {"max_tokens": {"INT32", "INT64", "UINT32", "UINT64"}}
OUTPUT = "text_output"
_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "seed", "stop", "max_tokens", "response_format",
                  "structured_outputs", *structured_fields.GUIDED_FIELDS}


def _scalar(values: dict[str, list], name: str, default: object) -> object:
    v = values.get(name)
    if v is None:
        return default
    if len(v) != 1:
        raise invalid(f"input {name!r} must hold exactly one element, got {len(v)}")
    return v[0]


def _number(d: dict, key: str, kind: type) -> object:
    """A JSON number as `kind`; its range is resolve_params's to check (any size of integer comes in)."""
    if key not in d or d[key] is None:
        return None
    v = d[key]
    what = f"sampling_parameters.{key}"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"{what} must be {'an integer' if kind is int else 'a number'}")
    if isinstance(v, float) and not math.isfinite(v):
        raise invalid(f"{what} must be finite")
    if kind is int:
        if isinstance(v, float) and not v.is_integer():
            raise invalid(f"{what} must be an integer")
        return int(v)
    try:
        return float(v)
    except OverflowError as exc:  # an integer of hundreds of digits
        raise invalid(f"{what} must be finite") from exc


def _timeout(request: pb.ModelInferRequest) -> float | None:
    """The request parameter `timeout`, in microseconds as Triton's, as seconds (None: not given)."""
    if "timeout" not in request.parameters:
        return None
    param = request.parameters["timeout"]
    which = param.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param"):
        raise invalid("parameter 'timeout' must be an integer number of microseconds")
    value = getattr(param, which)
    if value <= 0:
        raise invalid(f"parameter 'timeout' must be positive, got {value}")
    return value / 1e6


def _salt(request: pb.ModelInferRequest) -> str | None:
    """The request parameter `cache_salt` (None: not given)."""
    if "cache_salt" not in request.parameters:
        return None
    param = request.parameters["cache_salt"]
    if param.WhichOneof("parameter_choice") != "string_param":
        raise invalid("parameter 'cache_salt' must be a string")
    return param.string_param


def _check_tensors(request: pb.ModelInferRequest) -> None:
    """Each input at most once, and each known one in a datatype it can be read as."""
    seen = set()
    for t in request.inputs:
        if t.name in seen:
            raise invalid(f"input {t.name!r} is given twice")
        seen.add(t.name)
        accepted = ACCEPTED.get(t.name)
        if accepted is not None and t.datatype not in accepted:
            raise invalid(f"input {t.name!r} must be {' or '.join(sorted(accepted))}, got {t.datatype!r}")


class LlmRequest:
    """A ModelInferRequest read as Triton's LLM tensors: by admission first (context.WireRequest: the
    tensors' names and datatypes, the cache salt, the prompt and sampling options, the sampling numbers),
    then for how to answer (`delivery`). Read in this order, its errors keep their precedence.
    `unary`: ModelInfer, answered whole whatever the `stream` input says."""

    def __init__(self, request: pb.ModelInferRequest, unary: bool) -> None:
        self.request = request
        self.unary = unary
        self.prompt = ""  # text_input, once read
        self.exclude_input = False  # once `delivery` has read it
        self._values: dict[str, list] = {}
        self._sampling: dict = {}
        self._stop: list[str] = []
        self._max_tokens: object = None

    @property
    def model(self) -> str:
        """KServe names the model on every call: an empty name is no model's."""
        return self.request.model_name or "<empty>"

    def check(self) -> None:
        _check_tensors(self.request)

    @property
    def cache_salt(self) -> str | None:
        return _salt(self.request)

    def prompt_input(self) -> str:
        """text_input; sampling_parameters and max_tokens are read (and checked) here too."""
        self._values = values = read_inputs(self.request)
        unknown = set(values) - {n for n, *_ in INPUTS}
        if unknown:
            raise invalid(f"unknown inputs {sorted(unknown)}; accepted: {[n for n, *_ in INPUTS]}")
        raw_prompt = _scalar(values, "text_input", None)
        if raw_prompt is None:
            raise invalid("input 'text_input' is required")
        try:
            self.prompt = raw_prompt.decode() if isinstance(raw_prompt, bytes) else str(raw_prompt)
        except UnicodeDecodeError as exc:
            raise invalid("text_input is not valid UTF-8") from exc
        sp_raw = _scalar(values, "sampling_parameters", b"{}")
        try:
            sp = json.loads(sp_raw or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise invalid(f"sampling_parameters is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise invalid("sampling_parameters is nested too deeply") from exc
        if not isinstance(sp, dict):
            raise invalid("sampling_parameters must be a JSON object")
        unknown = set(sp) - _SAMPLING_KEYS
        if unknown:
            raise invalid(
                f"unknown sampling_parameters {sorted(unknown)}; accepted: {sorted(_SAMPLING_KEYS)}"
            )
        stop = sp.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid("sampling_parameters.stop must be a string or a list of strings")
        max_tokens = _scalar(values, "max_tokens", None)
        if max_tokens is None:
            max_tokens = _number(sp, "max_tokens", int)
        self._sampling, self._stop, self._max_tokens = sp, stop, max_tokens
        return self.prompt

    def sampling(self) -> dict[str, Any]:
        sp = self._sampling
        try:
            response_format = sp.get("response_format")
            if response_format is not None and not isinstance(response_format, dict):
                raise invalid("must be an object", "response_format")
            asked = structured_fields.requested(response_format, sp)
        except RequestError as exc:  # KServe's errors are a message: it names the field
            raise invalid(f"sampling_parameters.{exc.param}: {exc.message}") from exc
        structured = {} if asked is None else {
            "structured_output": asked[0], "structured_output_param": f"sampling_parameters.{asked[1]}"}
        return structured | {
            "temperature": _number(sp, "temperature", float),
            "top_p": _number(sp, "top_p", float),
            "top_k": _number(sp, "top_k", int),
            "seed": _number(sp, "seed", int),
            "max_tokens": self._max_tokens,
            "stop": self._stop,
        }

    def delivery(self) -> Delivery:
        """The inputs and parameter that shape the answer, not the generation: once admitted."""
        stream = bool(_scalar(self._values, "stream", False))
        self.exclude_input = bool(_scalar(self._values, "exclude_input_in_output", False))
        return Delivery(stream and not self.unary, _timeout(self.request))

    def answer(self, text: str) -> str:
        """The text a response carries: the prompt first unless the request excludes it."""
        return text if self.exclude_input else self.prompt + text


SERVICE = "inference.GRPCInferenceService"
VERSION = "1"  # the served model's one version
log = logging.getLogger(__name__)


async def _no_statistics() -> list[c.ModelStats]:
    return []


def _duration(d: c.Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


def _model_statistics(s: c.ModelStats) -> pb.ModelStatistics:
    stats = pb.InferStatistics(
        success=_duration(s.success),
        fail=_duration(s.fail),
        queue=_duration(s.queue),
        compute_input=_duration(s.compute_input),
        compute_infer=_duration(s.compute_infer),
        compute_output=_duration(s.compute_output),
    )
    return pb.ModelStatistics(
        name=s.name,
        version=VERSION,
        last_inference=s.last_inference_ms,
        inference_count=s.inference_count,
        execution_count=s.execution_count,
        inference_stats=stats,
    )


class KServeServicer(Servicer, pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        holder: ContextHolder,
        telemetry: RequestTelemetry,
        max_message_bytes: int | None = None,
        is_live: Callable[[], bool] = lambda: True,
        statistics: Callable[[], Awaitable[list[c.ModelStats]]] = _no_statistics,
        served_name: str = "",
    ) -> None:
        super().__init__(holder, telemetry, max_message_bytes)
        self.is_live = is_live  # False once the engine process is gone
        self.statistics = statistics  # the pod's, every front's requests together (pod_statistics.py)
        self.served_name = served_name  # the model's name while it still loads

    def _ready(self) -> bool:
        return self.holder.ctx is not None and self.holder.ctx.is_ready()

    # -- liveness, readiness, metadata ----------------------------------------------------------
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.is_live())

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        ctx = self.holder.ctx
        return pb.ModelReadyResponse(ready=self._ready() and ctx is not None and request.name == ctx.name)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name="tandem", version=__version__, extensions=["model_configuration", "statistics"]
        )

    def _model(self, name: str) -> ModelContext:
        ctx = self.ctx
        if name != ctx.name:
            ctx.check_model(name or "<empty>")
        return ctx

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        try:
            ctx = self._model(request.name)
        except RequestError as err:
            await abort(context, err)
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=ctx.name,
            versions=[VERSION],
            platform="tandem",
            inputs=[T(name=n, datatype=dt, shape=[1]) for n, dt, _, _ in INPUTS],
            outputs=[T(name=OUTPUT, datatype="BYTES", shape=[-1])],
        )

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        try:
            ctx = self._model(request.name)
        except RequestError as err:
            await abort(context, err)
        config = mc.ModelConfig(
            name=ctx.name,
            platform="tandem",
            backend="tandem",
            max_batch_size=0,
            input=[mc.ModelInput(name=n, data_type=t, dims=[1], optional=opt) for n, _, t, opt in INPUTS],
            output=[mc.ModelOutput(name=OUTPUT, data_type=mc.TYPE_STRING, dims=[-1])],
            model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
        )
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        """Triton's statistics of the served model (an empty name: every model, i.e. it)."""
        try:
            ctx = self._model(request.name) if request.name else self.ctx
            if request.version not in ("", VERSION):
                why = f"model {ctx.name!r} has no version {request.version!r}; it has {VERSION!r}"
                raise RequestError(ErrorKind.NOT_FOUND, why)
            models = {s.name: s for s in await self.statistics()}
        except RequestError as err:
            await abort(context, err)
        stats = models.get(ctx.name, c.ModelStats(ctx.name))  # none yet: all zero
        return pb.ModelStatisticsResponse(model_stats=[_model_statistics(stats)])

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        """The one served model: READY exactly when ModelReady says so, else UNAVAILABLE and why."""
        ctx = self.holder.ctx
        if ctx is None:
            entry = (self.served_name, "UNAVAILABLE", "the model is loading")
        elif self._ready():
            entry = (ctx.name, "READY", "")
        elif not self.is_live():
            entry = (ctx.name, "UNAVAILABLE", "the engine process has stopped")
        else:
            entry = (ctx.name, "UNAVAILABLE", "the server is warming up or draining")
        name, state, reason = entry
        if request.ready and state != "READY":
            return pb.RepositoryIndexResponse()
        index = pb.RepositoryIndexResponse.ModelIndex(name=name, version=VERSION, state=state, reason=reason)
        return pb.RepositoryIndexResponse(models=[index])

    # -- inference ------------------------------------------------------------------------------
    def _generate(
        self, context: grpc.aio.ServicerContext, req: LlmRequest, method: str
    ) -> AsyncIterator[GenerationChunk]:
        """The request's `id` only correlates responses on the client's stream (it is not unique
        across clients), so the engine gets an id of its own. Triton's LLM tensors carry a raw
        prompt: a text completion."""
        return self.generate(context, req, f"{SERVICE}/{method}", "text_completion", req.request.id)

    def _response(
        self, request: pb.ModelInferRequest, text: str, final: bool | None
    ) -> pb.ModelInferResponse:
        tensor, raw = bytes_output(OUTPUT, [text.encode()])
        resp = pb.ModelInferResponse(
            model_name=self.ctx.name, model_version=VERSION, id=request.id, outputs=[tensor],
            raw_output_contents=[raw],
        )
        if final is not None:
            resp.parameters["triton_final_response"].bool_param = final
        return resp

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        try:
            req = LlmRequest(request, unary=True)
            done = await whole_answer(self._generate(context, req, "ModelInfer"))
        except RequestError as err:
            await abort(context, err)
        response = self._response(request, req.answer(done.text), None)
        await abort_if_too_large(context, response, self.max_message_bytes)
        return response

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests on one stream run concurrently; a bad request gets an error_message, not a dead stream."""
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: list[asyncio.Task] = []

        async def one(request: pb.ModelInferRequest) -> None:
            try:
                req = LlmRequest(request, unary=False)
                chunks = self._generate(context, req, "ModelStreamInfer")
                text = req.answer
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        last = chunk.finish_reason is not None
                        response = self._response(request, text(chunk.text), last)
                        await out.put(pb.ModelStreamInferResponse(infer_response=response))
                        text = str  # the prompt goes with the first response only
            except RequestError as err:
                await out.put(pb.ModelStreamInferResponse(error_message=err.message))
            except Exception as exc:  # a fault of ours: this request fails, the stream goes on
                log.exception("a request on a ModelStreamInfer stream failed")
                await out.put(pb.ModelStreamInferResponse(error_message=f"internal error: {exc}"))

        async def reader() -> None:
            try:
                async for request in request_iterator:
                    tasks.append(asyncio.create_task(one(request)))
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:  # the stream's end, however it came: the response side must never wait forever
                await out.put(None)

        feeder = asyncio.create_task(reader())
        try:
            while (item := await out.get()) is not None:
                yield item
        finally:  # the client went away or the stream ended: stop whatever still runs
            feeder.cancel()
            for task in tasks:
                task.cancel()
