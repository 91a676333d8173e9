"""What a front's servicers share: the served model, its tokenizer and limits, and admission.

`ModelContext` is the one place a request is admitted: readiness, model name, prompt encoding and
checks, the engine's own request id; the servicers only map their API's fields onto it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from ..engine.errors import ErrorKind, RequestError, invalid
from ..engine.sampling_params import SamplingParams
from ..engine.validation import Limits, validate_prompt
from ..ipc.messages import ModelInfo
from .engine_client import EngineClient
from .request_stream import GenerationChunk


@dataclass
class ModelContext:
    engine: EngineClient
    tokenizer: PreTrainedTokenizerBase
    limits: Limits
    model: ModelInfo  # as the engine reported it
    is_ready: Callable[[], bool] = lambda: True  # health: engine warm, tokenizer loaded, not draining

    @property
    def name(self) -> str:
        """The served model's name."""
        return self.model.name

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def check_model(self, requested: str) -> None:
        """An empty name means the served model; any other name must be it."""
        if requested and requested != self.name:
            raise RequestError(
                ErrorKind.NOT_FOUND,
                f"model {requested!r} is not served here; this server serves {self.name!r}",
            )

    def check_ready(self) -> None:
        if not self.is_ready():
            raise RequestError(ErrorKind.UNAVAILABLE, "the server is not ready (warming up or draining)")

    def encode_text(self, text: str) -> list[int]:
        if not text:
            raise invalid("prompt is empty")
        return self.tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.has_chat_template:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"model {self.name!r} has no chat template")
        if not messages:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, "chat has no messages")
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # template errors (e.g. roles out of order) are the caller's
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"chat template failed: {exc}") from exc
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Admit a request (RequestError if it is not) and stream its chunks. `request_id`: the
        client's own, refused while another request of this front uses it."""
        validate_prompt(prompt_ids, self.limits)
        return self.engine.generate(prompt_ids, params, self.tokenizer, request_id)

    async def generate_all(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerationChunk:
        validate_prompt(prompt_ids, self.limits)
        return await self.engine.generate_all(prompt_ids, params, self.tokenizer, request_id)


class ContextHolder:
    """The servicers start before the model has loaded; until then calls get UNAVAILABLE."""

    def __init__(self) -> None:
        self.ctx: ModelContext | None = None

    def get(self) -> ModelContext:
        if self.ctx is None:
            raise RequestError(ErrorKind.UNAVAILABLE, "the model is still loading")
        return self.ctx
