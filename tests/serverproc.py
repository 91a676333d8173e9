"""Run a real `tandem serve` process on loopback for tests, and wait until it is SERVING."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"server at {address} not SERVING after {timeout} s")


@contextlib.contextmanager
def running_server(
    model: Path | None, *extra: str, log: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (address, process). `model` None = the embedded default model; `env`: added variables.

    The metrics endpoint is off unless `extra` sets --metrics-port (9400 would clash between servers);
    the KV cache is 0.25 GiB unless `extra` sizes it.
    """
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        *extra,
    ]
    if model is not None:
        cmd += ["--model", str(model)]
    if "--metrics-port" not in extra:
        cmd += ["--metrics-port", "0"]
    if "--num-kv-blocks" not in extra and "--kv-cache-cpu-gib" not in extra:
        cmd += ["--kv-cache-cpu-gib", "0.25"]  # the 2 GiB default takes seconds to zero at every start
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
    env = {**os.environ, **(env or {}), "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/")
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, proc)
        yield address, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log:
            out.close()
