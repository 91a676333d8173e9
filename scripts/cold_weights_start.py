"""Starts of `tandem serve` whose weight files are not in the page cache (a node that never read the
model), with the weights read ahead of the engine's imports and without (TANDEM_PREFETCH_WEIGHTS),
alternating: each start's SERVING time and phases as its log says them.

    PYTHONSAFEPATH=1 python scripts/cold_weights_start.py --runs 3            # the embedded model
    PYTHONSAFEPATH=1 python scripts/cold_weights_start.py --model DIR --runs 3

Each start evicts the model's weight files first (posix_fadvise DONTNEED: pages of files this user
may read, nothing else). docs/benchmarks.md (`tandem bench start`) has the numbers.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.service.models.prefetch import weight_files

SERVING = re.compile(r"serving ([\d.]+) s after the process started \((.*)\)")


def evict(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def start(model: str | None, prefetch: bool, log: Path) -> str:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TANDEM_PREFETCH_WEIGHTS": str(prefetch).lower()}
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", "0", "--http-port", "0"]
    cmd += ["--model", model] if model else []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            for _ in range(1200):
                found = SERVING.search(log.read_text())
                if found:
                    return f"SERVING after {found[1]} s ({found[2]})"
                if proc.poll() is not None:
                    return f"exited {proc.returncode}: see {log}"
                time.sleep(0.1)
            return "not serving within 120 s"
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    files = weight_files(a.model, None)
    size = sum(f.stat().st_size for f in files)
    print(f"weights: {', '.join(map(str, files))} ({size / 2**20:.0f} MiB)")
    logs = Path(tempfile.mkdtemp(prefix="tandem-cold-weights-"))
    for run in range(a.runs):
        for prefetch in (False, True):
            evict(files)
            said = start(a.model, prefetch, logs / f"serve-{run}-{prefetch}.log")
            print(f"read ahead {'on ' if prefetch else 'off'}: {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
