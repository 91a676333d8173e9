"""`tandem health`: ask a server's grpc.health.v1 service whether it is SERVING (for probes and `helm test`).

It needs only grpcio and the health stubs, never the engine: the slim operator image runs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import connect

SERVING = health_pb2.HealthCheckResponse.SERVING
# wait_serving asks every 0.2 s; its channel should retry the connection about as often. With grpc's
# default backoff (1 s, growing 1.6-fold to 2 min) a server whose port opens after ~15 s of start-up
# is first seen seconds after it serves. (The connect attempt's own deadline stays grpc's default.)
POLL_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]


def check(
    target: str,
    service: str = "",
    timeout: float = 10.0,
    creds: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
) -> str:
    """The health status name of `service` at `target` (host:port), or the gRPC error code's name.

    Waits for the connection up to `timeout` seconds (a Service that just got its first endpoint
    still answers), then asks once. `creds`: TLS (health needs no token).
    """
    with connect.channel(target, creds, connect.server_name_option(server_name)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
            )
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(target: str, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Ask until the server at `target` says SERVING (a server that starts answers NOT_SERVING first).

    TimeoutError after `timeout` seconds; RuntimeError as soon as `alive()` is False (its process ended).
    """
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target, options=POLL_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(f"the server at {target} stopped before it was SERVING")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"the server at {target} was not SERVING after {timeout:.0f} s")


def run(
    target: str,
    service: str,
    timeout: float,
    creds: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
) -> int:
    """Print the status; exit status 0 only for SERVING."""
    status = check(target, service, timeout, creds, server_name)
    label = f"{target} {service}".rstrip()
    print(f"{label}: {status}")
    return 0 if status == health_pb2.HealthCheckResponse.ServingStatus.Name(SERVING) else 1
