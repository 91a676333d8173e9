"""`tandem bench gpu --smoke`: the benchmark runs from the CLI and writes its table and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_tandem_bench_gpu_smoke_writes_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(tandem), "bench", "gpu", "--smoke", "--skip-hf", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| tandem |" in proc.stdout and "roofline (decode)" in proc.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "gpu_sync" and result["smoke"] is True
    assert result["tandem"]["tokens"] == result["workload"]["requests"] * result["workload"]["new_tokens"]
    assert result["roofline"]["copy_bandwidth_TBps"] > 0
    assert result["imported_server_only_modules"] == []


def test_tandem_bench_rejects_unknown_benchmark():
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run([str(tandem), "bench", "nope"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
