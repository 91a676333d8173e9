"""The pod's model statistics as a front gets them: asked of the supervisor, which keeps them from every
front's finished requests (telemetry/model_statistics.py), so that whichever front a client reaches
answers for the whole pod. The answer comes back on the front's inbox (engine_client.py routes it)."""

from __future__ import annotations

from collections.abc import Callable

from .. import contract as c
from .replies import Replies

ANSWER_TIMEOUT_S = 5.0


class PodStatistics:
    def __init__(self, front: int, send: Callable[[object], None]) -> None:
        self.front = front
        self._send = send  # to the supervisor
        self._replies: Replies[list[c.ModelStats]] = Replies(
            ANSWER_TIMEOUT_S, "the pod's statistics did not come in time"
        )

    async def models(self) -> list[c.ModelStats]:
        """Every model's statistics, as of the supervisor's latest records (UNAVAILABLE: no answer)."""
        return await self._replies.ask(lambda query: self._send(c.StatisticsQuery(self.front, query)))

    def answer(self, reply: c.StatisticsReply) -> None:
        self._replies.answer(reply.query, reply.models)
