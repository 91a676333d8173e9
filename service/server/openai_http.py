"""The OpenAI-compatible HTTP API of a front: `/v1/chat/completions`, `/v1/completions` (streamed as
server-sent events or whole), `/v1/models` (with where the model's tokenizer files are, and the
files themselves), vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`, and the probes
`/health` (liveness) and `/ready` (readiness, as the front's gRPC health).

It admits requests through the same `ModelContext` as the gRPC servicers and feeds the same
`EngineClient`, on the front's event loop. Every refusal is an OpenAI error body with its HTTP
status (request_error); a streamed response starts once its first chunk is ready, so that a request
the engine refuses (queue full) still gets its status. A client that goes away, streaming or not,
aborts its request in the engine. Every /v1 request, and the tokenizer endpoints, need the bearer token
when a token file is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive

from ..contract import RequestError, invalid
from ..telemetry.requests import RequestTelemetry
from . import sse
from .auth import TokenFile, bearer_token
from .context import ContextHolder, ModelContext, whole_answer
from .interceptor_kit import RateLimitedLog
from .openai_responses import (
    ChatResponse,
    CompletionResponse,
    Echo,
    TokenTexts,
    error_body,
    request_error,
)
from .openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat,
)
from .request_stream import GenerationChunk
from .tool_calls.reply import CallReply
from .validation import check_token_ids

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_REQUEST_ID_CHARS = 256
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the log may


class ApiError(Exception):
    """A refusal outside the engine's RequestError kinds (authentication, body size)."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, None, code)


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(sse.encode_json(body), status, headers, media_type="application/json")


def _shared(locs: Iterable[tuple]) -> tuple:
    """The longest start all `locs` share."""
    it = iter(locs)
    prefix = next(it)
    for loc in it:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a body that did not parse or validate. The field is the one all its
    errors share: a value that fits no member of a union (`stop`: a string or a list) has one error
    per member, under the member's name."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}", None
    loc = _shared(e["loc"] for e in errors)
    if not loc:
        return f"the request body must be a JSON object: {first['msg']}", None
    where = ".".join(str(p) for p in loc)
    said = list(dict.fromkeys(e["msg"] for e in errors))[:3]
    return f"{where}: {'; or '.join(said)}", where


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the request's body has been read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None once the client went away first: `work` is then cancelled, which ends
    its request's stream and so aborts it in the engine."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (the server stops)
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))  # its trace ends as cancelled, its request is aborted
    if not task.cancelled():
        task.exception()  # it ended otherwise meanwhile: nobody is left to tell
    return None


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for item in rest:
        yield item


class OpenAIApi:
    def __init__(
        self,
        holder: ContextHolder,
        telemetry: RequestTelemetry,
        max_body_bytes: int,
        tokens: TokenFile | None = None,
        is_live: Callable[[], bool] = lambda: True,
        is_ready: Callable[[], bool] = lambda: True,
    ) -> None:
        self.holder = holder
        self.telemetry = telemetry
        self.max_body_bytes = max_body_bytes
        self.tokens = tokens
        self.is_live = is_live  # False once the engine process is gone
        self.is_ready = is_ready  # as the gRPC health: warm, every front ready, not draining
        self.started = int(time.time())
        self._texts: TokenTexts | None = None
        self._log_refused = RateLimitedLog(log, "unauthenticated HTTP request")
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="Tandem OpenAI-compatible API", docs_url=None, redoc_url=None)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        # before /v1/models/{model:path}, which would take these paths for a model's name
        tokenizer = "/v1/models/{model:path}/tokenizer"
        app.add_api_route(tokenizer, self.tokenizer, methods=["GET"])
        app.add_api_route(tokenizer + "/{file:path}", self.tokenizer_file, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/tokenizer_info", self.tokenizer_info, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ready", self.ready, methods=["GET"])
        app.add_exception_handler(RequestError, self._request_error)
        app.add_exception_handler(ApiError, self._api_error)
        app.add_exception_handler(ValidationError, self._invalid_body)
        app.add_exception_handler(HTTPException, self._http_error)
        app.add_exception_handler(Exception, self._internal_error)
        return app

    # -- errors ---------------------------------------------------------------------------------------
    @staticmethod
    def _headers(request: Request) -> dict[str, str] | None:
        rid = getattr(request.state, "request_id", None)
        return {"x-request-id": rid} if rid else None

    async def _request_error(self, request: Request, exc: RequestError) -> Response:
        status, body = request_error(exc)
        return _json(body, status, self._headers(request))

    async def _api_error(self, request: Request, exc: ApiError) -> Response:
        headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
        return _json(exc.body, exc.status, headers)

    async def _invalid_body(self, request: Request, exc: ValidationError) -> Response:
        message, param = _validation_message(exc)
        return _json(error_body(message, "invalid_request_error", param), 400)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        """Routing's refusals (unknown path 404, wrong method 405) in OpenAI's shape."""
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return _json(error_body(message, "invalid_request_error"), exc.status_code, exc.headers)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        return _json(error_body(f"internal error: {exc}", "server_error", None, "internal_error"), 500)

    # -- admission --------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> bytes | None:
        """The request's accepted bearer token (None without a token file: nothing to present); 401
        (ApiError) without one the file holds."""
        if self.tokens is None:
            return None
        presented = bearer_token(request.headers.get("authorization"))
        if presented is not None and self.tokens.accepts(presented):
            return presented
        why = "missing bearer token" if presented is None else "bearer token not accepted"
        self._log_refused(request.url.path, why)  # never the token itself
        raise ApiError(401, why, "invalid_request_error", "invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        """The request body, refused (413) past the message limit before more of it is read."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length", "")
        parts, size = [], int(length) if length.isdigit() else 0
        if size <= limit:
            size = 0
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    break
                parts.append(part)
        if size > limit:
            message = f"the request body exceeds the server's limit of {limit} bytes (--max-message-bytes)"
            raise ApiError(413, message, "invalid_request_error", "request_too_large")
        return b"".join(parts)

    def _request_id(self, request: Request) -> str:
        """The caller's X-Request-Id (echoed in the response's header and id) or a fresh one."""
        rid = request.headers.get("x-request-id")
        if rid is None:
            rid = uuid.uuid4().hex
        elif not (0 < len(rid) <= MAX_REQUEST_ID_CHARS and rid.isprintable()):
            raise invalid(f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} printable characters")
        request.state.request_id = rid
        return rid

    def _response(
        self, ctx: ModelContext, body: ChatCompletionRequest | CompletionRequest, rid: str
    ) -> ChatResponse | CompletionResponse:
        texts = None
        sampling = body.sampling()
        if sampling["logprobs"] or sampling["prompt_logprobs"] is not None:
            if self._texts is None:  # one tokenizer per front, loaded once
                self._texts = TokenTexts(ctx.tokenizer)
            texts = self._texts
        if isinstance(body, ChatCompletionRequest):
            body.use_tools(ctx.tool_support)
            reading = body.tool_reading()
            calls = CallReply(reading) if reading is not None else None
            return ChatResponse(f"chatcmpl-{rid}", ctx.name, texts, body.return_token_ids, calls=calls)
        echo = None
        if body.echo or body.prompt_logprobs is not None:
            echo = Echo(
                text=body.prompt_text,
                decode=ctx.tokenizer.decode,
                echo=bool(body.echo),
                logprobs=body.logprobs,
                prompt_logprobs=body.prompt_logprobs,
                prompt_only=body.prompt_only,
            )
        return CompletionResponse(f"cmpl-{rid}", ctx.name, texts, body.return_token_ids, echo=echo)

    # -- generation -------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        token = self._authorize(request)
        body = ChatCompletionRequest.model_validate_json(await self._body(request))
        return await self._generate(request, body, "/v1/chat/completions", "chat", token)

    async def completions(self, request: Request) -> Response:
        token = self._authorize(request)
        body = CompletionRequest.model_validate_json(await self._body(request))
        return await self._generate(request, body, "/v1/completions", "text_completion", token)

    async def _generate(
        self, request: Request, body: ChatCompletionRequest | CompletionRequest, route: str, operation: str,
        token: bytes | None,
    ) -> Response:
        """`token`: the caller's accepted bearer token (its prefix-cache scope), or None."""
        rid = self._request_id(request)
        ctx = self.holder.get()
        trace = self.telemetry.http_request(request.headers, route, operation)
        out = self._response(ctx, body, rid)
        headers = {"x-request-id": rid}
        chunks = ctx.generate(body, token, trace, out.id)
        if body.streams:
            events = self._events(chunks, body, out)
            first = await _unless_gone(request, events.__anext__())
            if first is None:
                return Response(status_code=CLIENT_GONE)
            return StreamingResponse(
                _prepend(first, events), media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers}
            )
        done = await _unless_gone(request, whole_answer(chunks))
        if done is None:
            return Response(status_code=CLIENT_GONE)
        return _json(out.whole(done), headers=headers)

    async def _events(
        self,
        chunks: AsyncIterator[GenerationChunk],
        body: ChatCompletionRequest | CompletionRequest,
        out: ChatResponse | CompletionResponse,
    ) -> AsyncIterator[bytes]:
        """The stream's events. An error before the first one raises (the handler answers with its
        status); after it, the stream ends with an error event, as vLLM's do."""
        sent = False
        last: GenerationChunk | None = None
        usage = body.include_usage
        try:
            async with contextlib.aclosing(chunks):  # the client gone: its generation ends now
                async for chunk in chunks:
                    last = chunk
                    event = out.stream_chunk(chunk, usage)
                    if event is not None:
                        yield sse.event(event)
                        sent = True
        except RequestError as err:
            if not sent:
                raise
            yield sse.event(request_error(err)[1])
            yield sse.DONE
            return
        except Exception as exc:  # a fault of ours, mid-stream: this stream ends, the server goes on
            if not sent:
                raise
            log.exception("a streamed HTTP request failed")
            yield sse.event(error_body(f"internal error: {exc}", "server_error", None, "internal_error"))
            yield sse.DONE
            return
        if usage and last is not None:
            yield sse.event(out.usage_chunk(last))
        yield sse.DONE

    # -- models and probes --------------------------------------------------------------------------
    def _card(self, ctx: ModelContext) -> dict:
        return {
            "id": ctx.name,
            "object": "model",
            "created": self.started,
            "owned_by": "tandem",
            "max_model_len": ctx.limits.max_model_len,  # vLLM's extension
            "tokenizer": self._tokenizer(ctx),  # Tandem's: where its files are (tokenizer_files.py)
        }

    @staticmethod
    def _tokenizer(ctx: ModelContext) -> dict:
        return {"url": f"/v1/models/{quote(ctx.name)}/tokenizer", "files": sorted(ctx.tokenizer_files)}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return _json({"object": "list", "data": [self._card(self.holder.get())]})

    async def model(self, request: Request, model: str) -> Response:
        self._authorize(request)
        ctx = self.holder.get()
        ctx.check_model(model)
        return _json(self._card(ctx))

    async def tokenizer(self, request: Request, model: str) -> Response:
        """Where the served model's tokenizer files are: GET {url}/{file} for each of `files`."""
        self._authorize(request)
        ctx = self.holder.get()
        ctx.check_model(model)
        return _json(self._tokenizer(ctx))

    async def tokenizer_file(self, request: Request, model: str, file: str) -> Response:
        """One file of the served model's tokenizer; any other name, a path included, is 404."""
        self._authorize(request)
        ctx = self.holder.get()
        ctx.check_model(model)
        path = ctx.tokenizer_files.get(file)
        if path is None:
            files = ", ".join(sorted(ctx.tokenizer_files))
            message = f"{file!r} is not a file of the tokenizer of {ctx.name!r}; its files: {files}"
            raise ApiError(404, message, "invalid_request_error", "not_found")
        return FileResponse(path)

    # -- tokenizer --------------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        """vLLM's: a prompt's token ids (with the tokenizer's special tokens unless
        add_special_tokens is false), or a chat's as its template renders it."""
        self._authorize(request)
        body = TokenizeRequest.model_validate_json(await self._body(request))
        ctx = self.holder.get()
        ctx.check_model(body.model or "")
        body.check()
        if body.messages is not None:
            prompt = chat(body.messages, body.tools, ctx.tool_support)
            ids = await ctx.encode_chat(prompt.messages, body.add_generation_prompt, prompt.tools)
        else:
            ids = await ctx.tokenize(body.prompt, body.add_special_tokens)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": ctx.limits.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's: token ids to their text (special tokens included)."""
        self._authorize(request)
        body = DetokenizeRequest.model_validate_json(await self._body(request))
        ctx = self.holder.get()
        ctx.check_model(body.model or "")
        check_token_ids("tokens", body.tokens, min(ctx.limits.vocab_size, len(ctx.tokenizer)))
        return _json({"prompt": ctx.tokenizer.decode(body.tokens)})

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's: the tokenizer's special tokens and chat template (lm-evaluation-harness's remote
        tokenizer reads it, then tokenizes through /tokenize)."""
        self._authorize(request)
        ctx = self.holder.get()
        tok = ctx.tokenizer
        return _json({
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": ctx.limits.max_model_len,
        })

    async def health(self) -> Response:
        """Liveness: 200 while the front can serve at all (loading and draining included)."""
        if self.is_live():
            return _json({"status": "live"})
        return _json({"status": "engine gone"}, 503)

    async def ready(self) -> Response:
        """Readiness: 200 exactly when the front's gRPC health says SERVING."""
        if self.holder.ctx is not None and self.is_ready():
            return _json({"status": "ready"})
        return _json({"status": "not ready"}, 503)
