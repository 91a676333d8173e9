"""The pod's ZeroMQ sockets: one folder of ipc:// endpoints, PUSH to send and PULL to receive.

Every socket is local and ours, so none drops or blocks: no high-water mark (a slow reader queues,
it never stalls the engine); a sender that closes waits at most a second to flush what it queued.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class Endpoints:
    folder: str  # a private temporary folder of the pod; ipc paths must stay under ~100 characters

    @property
    def engine(self) -> str:
        return f"ipc://{self.folder}/engine"

    @property
    def supervisor(self) -> str:
        return f"ipc://{self.folder}/supervisor"

    def front(self, index: int) -> str:
        return f"ipc://{self.folder}/front-{index}"


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000 if kind == zmq.PUSH else 0)  # bounded wait to flush at exit
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
    return sock


def pull(ctx: zmq.Context, address: str) -> zmq.Socket:
    """The receiving end, bound at `address` (several senders may connect)."""
    sock = _socket(ctx, zmq.PULL)
    sock.bind(address)
    return sock


def push(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A sending end connected to `address` (messages queue until the receiver has bound)."""
    sock = _socket(ctx, zmq.PUSH)
    sock.connect(address)
    return sock
