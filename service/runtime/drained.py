"""When a receiving thread last found its inbox empty, so that a reader can wait for it to catch up.

The supervisor records what the engine and the fronts report on a thread of its own. Both send their
report before the client gets its answer, so a client that scrapes `/metrics` after its answer
should find the answer counted; under load the receiving thread may still be working through the
reports already delivered to it. A scrape waits until the thread has found its inbox empty after
the scrape began: every report delivered before then is recorded.
"""

from __future__ import annotations

import threading
import time


class Drained:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._at = float("-inf")  # monotonic time of the last empty inbox
        self._receiving = False

    def receiving(self, on: bool) -> None:
        """The receiving thread starts (True) or stops (False): without it nobody catches up."""
        with self._changed:
            self._receiving = on
            self._changed.notify_all()

    def mark(self) -> None:
        """The receiving thread found its inbox empty: what was delivered so far is recorded."""
        with self._changed:
            self._at = time.monotonic()
            self._changed.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Block until the inbox was found empty after this call began (or `timeout_s` passed, or the
        thread is not receiving); whether it was."""
        start = time.monotonic()
        with self._changed:
            return self._changed.wait_for(lambda: self._at >= start or not self._receiving, timeout_s) and (
                self._at >= start
            )
