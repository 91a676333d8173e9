"""What the soak records per request (`Outcome`), in a module of its own: the checks and their tests
read it without importing a client's protos (tandem.kserve's clash with tritonclient's in one process)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Outcome:
    index: int
    kind: str
    status: str = "OK"
    seconds: float = 0.0
    messages: int = 0
    tokens: int | None = None  # native: token ids received
    completion_tokens: int | None = None  # native: usage on the last message
    finish_reason: str | None = None  # native
    finals: list[bool] = field(default_factory=list)  # KServe stream: triton_final_response per response
    error_message: str | None = None  # a KServe stream's error response, else the status's details
    cancelled: bool = False  # the soak cancelled the call itself
    prefix_ok: bool | None = None  # KServe without exclude_input: the output starts with the prompt
    text: str | None = None  # probes: the answer without the prompt
    token_ids: list[int] | None = None  # native probes
