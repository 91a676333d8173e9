"""The native `tandem.v1.Tandem` API."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

from ..contract import FinishReason, RequestError, StructuredOutput, TokenLogprob, invalid
from . import structured_fields
from .context import Chat, Delivery, Prompt, whole_answer
from .errors import abort, abort_if_too_large
from .request_stream import GenerationChunk
from .servicer import Servicer

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def _messages(chat: pb.ChatMessages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def _echoed_id(request: pb.GenerateRequest) -> str:
    """The request's `request_id`, only echoed back (the proto: "generated when empty"): the engine
    knows the request by an id of the front's own."""
    return request.request_id or uuid.uuid4().hex


@dataclass
class _Generation:
    """A GenerateRequest as admission reads it (context.WireRequest); `stream`: the RPC streams."""

    request: pb.GenerateRequest
    stream: bool

    @property
    def model(self) -> str:
        return self.request.model

    def check(self) -> None:
        """Nothing beyond the proto's own types."""

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt if self.request.HasField("cache_salt") else None

    def prompt_input(self) -> Prompt:
        which = self.request.WhichOneof("input")
        if which == "text":
            return self.request.text
        if which == "chat":
            return Chat(_messages(self.request.chat))
        if which == "token_ids":
            return list(self.request.token_ids.ids)
        raise invalid("no input: set one of text, chat or token_ids")

    def sampling(self) -> dict[str, Any]:
        s, st, lp = self.request.sampling, self.request.stopping, self.request.logprobs
        pl = self.request.prompt_logprobs
        return {
            "temperature": s.temperature if s.HasField("temperature") else None,
            "top_p": s.top_p if s.HasField("top_p") else None,
            "top_k": s.top_k if s.HasField("top_k") else None,
            "seed": s.seed if s.HasField("seed") else None,
            "max_tokens": st.max_tokens if st.HasField("max_tokens") else None,
            "stop": list(st.stop),
            "stop_token_ids": list(st.stop_token_ids),
            "ignore_eos": st.ignore_eos,
            "logprobs": lp.enabled,
            "top_logprobs": lp.top_logprobs,
            "prompt_logprobs": pl.top_logprobs if pl.enabled else None,
        } | self._structured_output()

    def _structured_output(self) -> dict[str, Any]:
        """The request's `structured_output`, as resolve_params's keyword arguments (none: {})."""
        if not self.request.HasField("structured_output"):
            return {}
        so = self.request.structured_output
        kind = so.WhichOneof("kind")
        param = f"structured_output.{kind}"
        if kind is None:
            raise invalid("structured_output sets none of its fields", "structured_output")
        if kind == "json_schema":
            constraint = StructuredOutput(json_schema=structured_fields.schema_text(so.json_schema, param))
        elif kind == "json_object":
            constraint = StructuredOutput(json_object=True) if so.json_object else None
        elif kind == "choice":
            constraint = StructuredOutput(choice=tuple(so.choice.options))
        else:
            constraint = StructuredOutput(**{kind: getattr(so, kind)})
        if constraint is None:
            return {}
        return {"structured_output": constraint, "structured_output_param": param}

    def delivery(self) -> Delivery:
        return Delivery(self.stream)

    @property
    def operation(self) -> str:
        """The GenAI operation: a chat, or a completion of text or token ids."""
        return "chat" if self.request.WhichOneof("input") == "chat" else "text_completion"


class TandemServicer(Servicer, pb_grpc.TandemServicer):
    def _generate(
        self, context: grpc.aio.ServicerContext, request: pb.GenerateRequest, method: str, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        wire = _Generation(request, stream=method == "GenerateStream")
        return self.generate(context, wire, f"tandem.v1.Tandem/{method}", wire.operation, request_id)

    def _token(self, token_id: int) -> str:
        return self.ctx.tokenizer.convert_ids_to_tokens(token_id) or ""

    def _logprob(self, token_id: int, lp: TokenLogprob) -> pb.TokenLogprob:
        out = pb.TokenLogprob(
            token_id=token_id,
            token=self._token(token_id),
            logprob=lp.logprob,
            top_logprobs=[pb.TopLogprob(token_id=i, token=self._token(i), logprob=v) for i, v in lp.top],
        )
        if lp.rank is not None:
            out.rank = lp.rank
        return out

    def _response(self, request_id: str, chunk: GenerationChunk) -> pb.GenerateResponse:
        out = pb.GenerateResponse(
            request_id=request_id,
            model=self.ctx.name,
            text=chunk.text,
            token_ids=chunk.token_ids,
            finish_reason=_FINISH[chunk.finish_reason],
        )
        for tid, lp in zip(chunk.token_ids, chunk.logprobs or [], strict=False):
            out.logprobs.append(self._logprob(tid, lp))
        if chunk.prompt_logprobs is not None and chunk.prompt_ids is not None:
            pairs = zip(chunk.prompt_ids[1:], chunk.prompt_logprobs, strict=False)
            out.prompt_logprobs.extend(self._logprob(tid, lp) for tid, lp in pairs)
        if chunk.finish_reason is not None:
            out.usage.prompt_tokens = chunk.prompt_tokens
            out.usage.completion_tokens = chunk.completion_tokens
            out.usage.cached_prompt_tokens = chunk.cached_tokens
            if chunk.stop_reason is not None:
                reason = chunk.stop_reason
                out.stop_reason = reason if isinstance(reason, str) else self._token(reason)
        return out

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        request_id = _echoed_id(request)
        try:
            answer = await whole_answer(self._generate(context, request, "Generate", request_id))
        except RequestError as err:
            await abort(context, err)
        response = self._response(request_id, answer)
        await abort_if_too_large(context, response, self.max_message_bytes)
        return response

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = _echoed_id(request)
        try:
            chunks = self._generate(context, request, "GenerateStream", request_id)
            async with contextlib.aclosing(chunks):  # the client gone: its generation ends now
                async for chunk in chunks:
                    yield self._response(request_id, chunk)
        except RequestError as err:
            await abort(context, err)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            self.ctx.check_model(request.model)
            which = request.WhichOneof("input")
            if which == "chat":
                ids = await self.ctx.encode_chat(_messages(request.chat))
            elif which == "text":
                ids = await self.ctx.tokenize(request.text, request.add_special_tokens)
            else:
                raise invalid("no input: set text or chat")
        except RequestError as err:
            await abort(context, err)
        return pb.TokenizeResponse(token_ids=ids, tokens=self.ctx.tokenizer.convert_ids_to_tokens(ids))

    async def GetModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        try:
            limits = self.ctx.limits
        except RequestError as err:
            await abort(context, err)
        return pb.ModelInfo(
            model=self.ctx.name,
            source=self.ctx.model.source,
            architecture=self.ctx.model.architecture,
            vocab_size=limits.vocab_size,
            max_context_length=limits.max_model_len,
            dtype=self.ctx.model.dtype,
            device=self.ctx.model.device,
            eos_token_ids=sorted(self.ctx.model.eos_token_ids),
            has_chat_template=self.ctx.has_chat_template,
            tokenizer_files=sorted(self.ctx.tokenizer_files),
        )

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.Load:
        try:
            s = await self.ctx.engine.load()
        except RequestError as err:
            await abort(context, err)
        return pb.Load(
            requests_running=s.running,
            requests_waiting=s.waiting,
            kv_cache_usage=s.kv_usage,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_free=s.kv_blocks_free,
            gpu_idle_fraction=s.idle_fraction,
        )
