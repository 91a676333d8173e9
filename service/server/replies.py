"""Questions a front sends down a one-way socket (to the engine, to the supervisor) and their answers,
matched by a query number: the engine's load (engine_client.py), the pod's statistics
(pod_statistics.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Generic, TypeVar

from ..contract import ErrorKind, RequestError

T = TypeVar("T")


class Replies(Generic[T]):
    def __init__(self, timeout_s: float, late: str) -> None:
        """`late`: what a question unanswered in `timeout_s` fails with (UNAVAILABLE)."""
        self.timeout_s = timeout_s
        self.late = late
        self._numbers = itertools.count()
        self._waiting: dict[int, asyncio.Future[T]] = {}

    async def ask(self, send: Callable[[int], None]) -> T:
        """Send the question under a new query number (`send`) and wait for its answer."""
        query = next(self._numbers)
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting[query] = future
        send(query)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError as exc:
            raise RequestError(ErrorKind.UNAVAILABLE, self.late) from exc
        finally:
            self._waiting.pop(query, None)

    def answer(self, query: int, value: T) -> None:
        future = self._waiting.pop(query, None)
        if future is not None and not future.done():
            future.set_result(value)

    def fail_all(self, error: Exception) -> None:
        """Nobody will answer any more (the process that would has stopped)."""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)
