"""Run start-up work (model load, engine build) in a daemon thread the event loop can await.

`asyncio.to_thread` uses the loop's executor, whose threads the interpreter joins at exit: a
SIGTERM during a long load would then wait for the load to finish. A daemon thread is not joined,
so a drained server can exit at once and abandon the work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], *args: object, name: str) -> T:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(setter: Callable[[object], None], value: object) -> None:
        if not future.done():  # the awaiting task may have been cancelled meanwhile
            setter(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task, re-raised there
            outcome = (future.set_exception, exc)
        else:
            outcome = (future.set_result, result)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future
