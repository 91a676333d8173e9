"""What one /metrics scrape costs an idle `tandem serve`: end-to-end time and the supervisor's CPU.

Starts the server on the embedded model (CPU), waits for SERVING, sends a few requests so every
series exists, then scrapes `--scrapes` times one after the other and reads the supervisor
process's CPU time (/proc, Linux) before and after. The endpoint picker of the inference gateway
scrapes each pod 20 times a second (docs/telemetry.md).

    PYTHONSAFEPATH=1 python scripts/scrape_cost.py --scrapes 200
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` (its threads included), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scrapes", type=int, default=200)
    a = ap.parse_args()
    grpc_port, metrics_port = free_port(), free_port()
    tandem = Path(sys.executable).with_name("tandem")
    log = Path(tempfile.mkdtemp(prefix="tandem-scrape-")) / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(tandem), "serve", "--host", "127.0.0.1", "--port", str(grpc_port),
                                 "--metrics-port", str(metrics_port), "--http-port", "0"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        address = f"127.0.0.1:{grpc_port}"
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=300)
            stub = pb_grpc.TandemStub(channel)
            hello = pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_tokens=4))
            deadline = time.monotonic() + 300
            while True:  # the engine may still be loading: retry until it answers
                try:
                    stub.Generate(hello, timeout=60)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        time.sleep(1.0)  # idle: the engine's last reports recorded
        cpu_before = cpu_seconds(proc.pid)
        times, size = [], 0
        for _ in range(a.scrapes):
            start = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as r:
                size = len(r.read())
            times.append(time.perf_counter() - start)
        cpu = cpu_seconds(proc.pid) - cpu_before
        print(f"{a.scrapes} scrapes of an idle server: {1e3 * statistics.median(times):.2f} ms median, "
              f"{1e3 * statistics.mean(times):.2f} ms mean, {1e3 * max(times):.2f} ms max end to end; "
              f"the supervisor's CPU {1e3 * cpu / a.scrapes:.2f} ms a scrape; {size / 1000:.1f} kB")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
