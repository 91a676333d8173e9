"""When a receiving thread last found its inbox empty, so that a reader can wait for it to catch up.

The supervisor records what the engine and the fronts report on a thread of its own. Both send their
report before the client gets its answer, so a client that scrapes `/metrics` after its answer
should find the answer counted; under load the receiving thread may still be working through the
reports already delivered to it. A scrape wakes the thread and waits until it has found its inbox
empty after the scrape began: every report delivered before then is recorded. An idle thread wakes
at once (the wake socket is among what it polls), so an idle pod's scrape waits for no poll timeout.
"""

from __future__ import annotations

import socket
import threading
import time


class Drained:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._at = float("-inf")  # monotonic time of the last empty inbox
        self._receiving = False
        # a byte sent on `_wake_out` wakes the receiving thread's poll of `wake` (any thread may send)
        self.wake, self._wake_out = socket.socketpair()
        for end in (self.wake, self._wake_out):
            end.setblocking(False)

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

    def woken(self) -> None:
        """The receiving thread was woken: take the wake bytes off its socket."""
        try:
            while self.wake.recv(4096):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout_s: float) -> bool:
        """Wake the receiving thread and block until it has found its inbox empty after this call
        began (or `timeout_s` passed, or no thread is receiving); whether it did."""
        start = time.monotonic()
        try:
            self._wake_out.send(b"\0")
        except BlockingIOError:  # the socket's buffer is full of wakes the thread has yet to take
            pass
        except OSError:  # closed: the thread has stopped receiving
            pass
        with self._changed:
            caught_up = self._changed.wait_for(lambda: self._at >= start or not self._receiving, timeout_s)
            return caught_up and self._at >= start

    def close(self) -> None:
        self.wake.close()
        self._wake_out.close()
