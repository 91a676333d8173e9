"""The server on CUDA: compile and graph capture happen off the event loop (on a GPU: -m gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import free_port

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

pytestmark = pytest.mark.gpu
SERVING = health_pb2.HealthCheckResponse.SERVING


def test_health_answers_while_the_engine_compiles_and_captures(tiny_model_dir, tmp_path):
    """Compiling the decode forward and capturing its graphs take seconds even for a tiny model
    (minutes for 8B): health checks keep being answered NOT_SERVING meanwhile, then SERVING, and
    the served engine generates."""
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cuda", "--model", str(tiny_model_dir("llama")), "--max-num-seqs", "8",
           "--metrics-port", "0", "--http-port", "0", "--num-kv-blocks", "512"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd="/",
                                env={**os.environ, "PYTHONSAFEPATH": "1"})
    try:
        answered: list[tuple[float, int]] = []  # (time, status) of every answered check
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    answered.append((time.monotonic(), status))
                    if status == SERVING:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
            assert answered and answered[-1][1] == SERVING, log.read_text()[-2000:]
            not_serving = [t for t, s in answered if s != SERVING]
            times = [t for t, _ in answered]
            longest_silence = max(b - a for a, b in zip(times, times[1:], strict=False))
            # compile + capture of the tiny model took 23 s on the H200 (seconds with a warm Inductor
            # cache); a blocked event loop would leave health unanswered for all of it
            assert not_serving[-1] - not_serving[0] > 4, "the build was too quick to tell"
            assert longest_silence < 3, f"health went unanswered for {longest_silence:.1f} s"
            stub = pb_grpc.TandemStub(channel)
            req = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=16, ignore_eos=True), text="Hi")
            tokens = [t for m in stub.GenerateStream(req, timeout=60) for t in m.token_ids]
            assert len(tokens) == 16
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
