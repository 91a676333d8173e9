"""The autoscaling simulation's pods come from a calibration file (bench/autoscale/calibration/):
the shipped file is what its measured result files give, and the file read sets the pods' speed."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import pytest

from tandem.bench.autoscale import calibrate, calibration, compare
from tandem.bench.autoscale.pods import Cluster

ROOT = Path(__file__).resolve().parent.parent


def test_the_shipped_calibration_is_built_from_its_result_files():
    shipped = calibration.read(calibration.DEFAULT)
    start = shipped["start"]
    rebuilt = calibrate.build(
        [ROOT / p for p in shipped["decode_step"]["sources"]],
        ROOT / shipped["prefill"]["source"],
        ROOT / start["source"],
    )
    assert rebuilt == shipped  # no number typed by hand where a result file holds it


def test_the_calibration_reproduces_the_steps_it_was_built_from():
    record = calibration.read(calibration.DEFAULT)
    model = calibration.load()
    for w in record["decode_step"]["measured"]:
        predicted = 1e3 * model.step_s(w["rows"], w["rows"] * w["context"])
        # the points exactly; the long-context check within 3%
        assert predicted == pytest.approx(w["median_step_ms"], rel=0.03 if w["context"] > 2048 else 1e-4)
    # the measured shape of the 8B step on an H100: about 6 ms alone, about 11 ms at 256 short contexts
    assert 5.5e-3 < model.step_s(1, 192) < 6.5e-3 and 10.5e-3 < model.step_s(256, 256 * 256) < 11.5e-3


def _slower(tmp_path: Path, factor: float) -> Path:
    record = calibration.read(calibration.DEFAULT)
    record["decode_step"]["points"] = [[b, s * factor] for b, s in record["decode_step"]["points"]]
    record["decode_step"]["kv_read_s_per_token"] *= factor
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(record))
    return path


def _tokens_per_s(model: calibration.PodModel) -> float:
    """One pod decoding a steady load it cannot keep up with (short prompts, long answers)."""
    cluster = Cluster(1, cold_start_s=60, model=model)
    history: deque = deque()
    for t in range(300):
        cluster.route(t, [[float(t), 20.0, 50.0, 1000.0]])
        history.append(cluster.step(t))
    return sum(s.tokens for s in list(history)[-60:]) / 60


def test_the_calibration_file_read_sets_the_pods_step_time(tmp_path: Path):
    fast, slow = calibration.load(), calibration.load(_slower(tmp_path, 2.0))
    assert slow.name == "slow"
    assert slow.step_s(100, 50_000) == pytest.approx(2 * fast.step_s(100, 50_000))
    # the pods decode at the speed of the file read: twice the step, half the tokens
    assert _tokens_per_s(slow) == pytest.approx(_tokens_per_s(fast) / 2, rel=0.05)


def test_tandem_bench_autoscale_reads_the_calibration_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    def one(*extra: str) -> dict:
        args = ["--one", "hpa_running", "--target", "64", "--hours", "0.25", "--start-s", "45", *extra]
        assert compare.main(args) == 0
        return json.loads(capsys.readouterr().out)

    default, slow = one(), one("--calibration", str(_slower(tmp_path, 3.0)))
    assert default["calibration"] == calibration.DEFAULT.stem and slow["calibration"] == "slow"
    assert slow["cost_per_million_tokens_usd"] > default["cost_per_million_tokens_usd"]
