"""`--api-processes auto`: the rule that sizes the front processes, the cores it counts (affinity and a
container's CPU quota, read from cgroup files) and the torch-free guess of where the engine computes.
A real `tandem serve` started with the default is checked in test_process_boundary.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from tandem.service.api_processes import MAX_AUTO_FRONTS, api_processes, auto_api_processes, engine_on_cuda
from tandem.service.cpus import cgroup_cpu_limit, usable_cores
from tandem.service.settings import ServerSettings


@pytest.mark.parametrize(
    ("cores", "on_cuda", "fronts"),
    [
        (1, False, 1), (16, False, 1), (128, False, 1),  # the engine computes on the cores: one front
        (1, True, 1), (2, True, 1), (3, True, 1), (4, True, 2), (5, True, 3),  # 2 cores kept for the engine
        (6, True, 4), (16, True, 4), (128, True, MAX_AUTO_FRONTS),  # an H100 node's 16 cores: 4 fronts
    ],
)  # fmt: skip
def test_the_rule(cores: int, on_cuda: bool, fronts: int) -> None:
    assert auto_api_processes(cores, on_cuda) == fronts


def test_auto_is_the_default_and_numbers_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_API_PROCESSES", raising=False)
    assert ServerSettings().api_processes == "auto"
    assert ServerSettings(api_processes="3").api_processes == 3  # as a flag or variable gives it
    monkeypatch.setenv("TANDEM_API_PROCESSES", "auto")
    assert ServerSettings().api_processes == "auto"
    monkeypatch.setenv("TANDEM_API_PROCESSES", "5")
    assert ServerSettings().api_processes == 5
    for bad in ("0", "65", "two", "2.5", "AUTO"):
        with pytest.raises(ValidationError):
            ServerSettings(api_processes=bad)


def test_a_number_is_kept_and_auto_resolved() -> None:
    assert api_processes(ServerSettings(api_processes=7, device="cuda")) == 7
    assert api_processes(ServerSettings(api_processes="auto", device="cpu")) == 1
    on_cuda = api_processes(ServerSettings(api_processes="auto", device="cuda"))
    assert on_cuda == auto_api_processes(usable_cores(), on_cuda=True)


def test_where_the_engine_computes(tmp_path: Path) -> None:
    none, gpu = tmp_path / "none", tmp_path / "gpu"
    none.mkdir()
    (none / "nvidiactl").touch()  # the driver's control node is no device
    gpu.mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia-uvm"):
        (gpu / name).touch()
    assert engine_on_cuda("cuda", {}, none) and not engine_on_cuda("cpu", {}, gpu)
    assert not engine_on_cuda("auto", {}, none)
    assert engine_on_cuda("auto", {}, gpu)
    assert engine_on_cuda("auto", {"CUDA_VISIBLE_DEVICES": "0,1"}, gpu)
    for hidden in ("", "-1", "-1,0"):
        assert not engine_on_cuda("auto", {"CUDA_VISIBLE_DEVICES": hidden}, gpu)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_cpu_quota(tmp_path: Path) -> None:
    proc = tmp_path / "proc-cgroup"
    # cgroup v2: the tightest quota of the process's cgroup and its ancestors
    v2 = tmp_path / "v2"
    _write(proc, "0::/kubepods/pod1/ctr\n")
    _write(v2 / "cpu.max", "max 100000\n")
    _write(v2 / "kubepods/pod1/cpu.max", "600000 100000\n")
    _write(v2 / "kubepods/pod1/ctr/cpu.max", "250000 100000\n")
    assert cgroup_cpu_limit(v2, proc) == 2.5
    _write(v2 / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(v2, proc) == 6.0
    _write(v2 / "kubepods/pod1/cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(v2, proc) is None
    # a container's own namespace: its cgroup is the root
    _write(proc, "0::/\n")
    _write(v2 / "cpu.max", "400000 100000\n")
    assert cgroup_cpu_limit(v2, proc) == 4.0
    # cgroup v1's cpu controller
    v1 = tmp_path / "v1"
    _write(v1 / "cpu,cpuacct/cpu.cfs_quota_us", "300000\n")
    _write(v1 / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(v1, tmp_path / "absent") == 3.0
    _write(v1 / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(v1, tmp_path / "absent") is None
    assert cgroup_cpu_limit(tmp_path / "nothing", tmp_path / "absent") is None


def test_usable_cores_are_at_most_the_affinity() -> None:
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))
