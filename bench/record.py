"""The one writer of benchmark results: where a result goes, what every record states, and its files.

A result is named by what it measures: `<date>_<gpu>_<benchmark>_<shape>.json` (date YYYY-MM-DD in
UTC; gpu a short lowercase name of the device, `h100`, `h200` or `cpu`; benchmark the `tandem
bench` name; shape the model shape and workload, such as `8b-256x256`), in bench/results/ of a
source checkout (the current directory where Tandem is installed from a wheel). Beside the JSON, a
benchmark may write a markdown table (.md) and a figure (.png) of the same name.

Every record states the command line (less where the run wrote its files), the date, the GPU (or
`cpu`), the commit (`git rev-parse` in a checkout, else the installed package's version) and the
machine's facts. Nothing here imports torch unless the device is a GPU (its name comes from torch).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CHECKOUT = BENCH.parent  # the repository root, when bench/ lies in a source checkout
RESULTS = BENCH / "results"  # data, not a package: present in a checkout only


def in_checkout() -> bool:
    return (CHECKOUT / "pyproject.toml").is_file() and RESULTS.is_dir()


def utc_date() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    """The checkout's commit, '+dirty' when service/ has uncommitted changes; outside a checkout (or
    without git), the installed package's version. TANDEM_BENCH_COMMIT names it for a copy of a
    checkout that has no git history (a tree copied to a GPU host)."""
    if given := os.environ.get("TANDEM_BENCH_COMMIT"):
        return given
    if in_checkout():
        try:

            def git(*args: str) -> str:
                return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True,
                                      timeout=10, check=True).stdout.strip()

            dirty = git("status", "--porcelain", "service")
            return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return f"tandem {versions('tandem')['tandem']}"


def machine() -> dict:
    """The machine and the checkout a benchmark ran on (without importing torch: it takes seconds)."""
    return {
        "commit": commit(),
        "date": utc_date(),
        "cpu": cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
    }


def versions(*packages: str) -> dict[str, str | None]:
    """Installed versions, read from the package metadata (nothing is imported)."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_name(device: object) -> str:
    """The device's full name (torch.cuda.get_device_name) for a CUDA device, else `cpu`."""
    if str(device).split(":")[0] != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(device if isinstance(device, torch.device) else None)


def short_gpu(name: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `h100`: the model number of a GPU's name, lowercase; `cpu` stays."""
    found = re.search(r"\b([A-Z]{1,3}\d{1,4}[A-Za-z]?)\b", name.removeprefix("NVIDIA "))
    if found:
        return found.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cpu"


# where a run wrote its files: no fact of the result, and a path of the machine it ran on
OUTPUT_OPTIONS = ("--out", "--logs", "--plot", "--timeline")


def command(benchmark: str, argv: Sequence[str]) -> str:
    """The command line that reproduces the run: its arguments, less where it wrote its files."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in OUTPUT_OPTIONS:
            skip = True  # and its value
        elif not arg.startswith(tuple(f"{option}=" for option in OUTPUT_OPTIONS)):
            kept.append(arg)
    return shlex.join(["tandem", "bench", benchmark, *kept])


class ResultFile:
    """Where one run of a benchmark writes, and what its record states besides its measurements.

    `out`: the JSON path the user chose (default: the standard name in `folder`, else bench/results/
    of a checkout, else the current directory). `device`: where the measured work ran (`cuda`,
    `cpu`, a torch.device)."""

    def __init__(self, benchmark: str, argv: Sequence[str], device: object, shape: str,
                 out: str | Path | None = None, folder: str | Path | None = None) -> None:
        self.gpu = gpu_name(device)
        self.facts = {"command": command(benchmark, argv), "date": utc_date(), "gpu": self.gpu,
                      "commit": commit()}
        self.figure: Path | None = None  # the last figure written
        if out is not None:
            self.path = Path(out)
        else:
            where = Path(folder) if folder is not None else (RESULTS if in_checkout() else Path.cwd())
            shape = shape.replace("_", "-")  # underscores part the name's fields
            self.path = where / f"{utc_date()}_{short_gpu(self.gpu)}_{benchmark}_{shape}.json"

    def write(self, record: dict, markdown: str | Callable[[dict], str] | None = None,
              draw: Callable[[Path], Path | None] | None = None) -> Path:
        """The record as JSON after the facts (and the machine's, as `environment`, unless the
        benchmark states its own), `markdown` beside it (.md; a callable renders it from the whole
        record), and the figure `draw` makes at the .png path. Safe to call again as a run goes
        on: a run cut short keeps what it measured."""
        clash = self.facts.keys() & record.keys()
        assert not clash, f"the record states {clash} itself: the writer's facts"
        full = {**self.facts, **record}
        full.setdefault("environment", machine())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(full, indent=2) + "\n")
        if markdown is not None:
            text = markdown if isinstance(markdown, str) else markdown(full)
            self.path.with_suffix(".md").write_text(text + "\n")
        if draw is not None:
            self.figure = draw(self.path.with_suffix(".png"))
        return self.path
