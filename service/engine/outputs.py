"""What the engine core hands back: each step's new tokens per request, and its load.

Plain records with no torch in them: they cross to the front processes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ErrorKind
from .sequence import FinishReason


@dataclass
class TokenLogprob:
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class SeqUpdate:
    """What one step did for one request, handed to the front: its new token (a step makes one per
    request), or its failure."""

    request_id: str
    token: int | None  # None: the request failed
    logprob: TokenLogprob | None = None  # where the request asks for logprobs
    finish_reason: FinishReason | None = None
    stop_token: int | None = None
    first: bool = False  # its first token: the front learns `scheduled_at` and `cached_tokens` with it
    scheduled_at: float | None = None  # wall clock of the request's first step (telemetry)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its admission (usage)
    error: str | None = None  # the request failed: it ends here, with `error_kind`'s status
    error_kind: ErrorKind = ErrorKind.INTERNAL


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float
    kv_blocks_total: int
    kv_blocks_free: int
    idle_fraction: float
    # prefix caching, since start (after the warm-up): prompt tokens looked up at admission, and
    # those found cached (their prefill skipped)
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # preemptions, since start, by what became of the K/V: copied to the host pool, or dropped (to
    # be recomputed); KV blocks copied to the pool and back, those not copied back because the
    # prefix cache still held them on the device, and those not copied out because a running
    # sequence shared them (kept); the share of the pool in use
    preemptions_offload: int = 0
    preemptions_recompute: int = 0
    kv_offload_blocks_out: int = 0
    kv_offload_blocks_in: int = 0
    kv_offload_blocks_reused: int = 0
    kv_offload_blocks_kept: int = 0
    kv_offload_usage: float = 0.0
