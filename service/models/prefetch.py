"""Ask the kernel to read a model's weight files into the page cache while the engine process is
still importing: a pod on a node that never read the model (a scale-up's new pod) then finds its
weights in memory when the loader opens them, instead of waiting on the disk after the imports.

Only hints (`posix_fadvise(WILLNEED)`, chunk by chunk: the kernel reads in the background, nothing
is copied into this process), and only for models that fit in the memory left to the process with
room to spare: the loader reads the same pages anyway, so the page cache holds no more than it would.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from ..cpus import CGROUP_ROOT, cgroup_v2_dirs
from .default_model import default_gguf_path
from .paths import model_files_dir

log = logging.getLogger(__name__)

# At most this share of the memory left to the process (the host's available memory, or the
# cgroup's room under its limit, whichever is less): pages read ahead that are evicted before the
# loader reaches them are read twice.
MEMORY_SHARE = 0.5
# The kernel reads at most a device's readahead size per hint (read_ahead_kb, 128 KiB by default):
# one hint per chunk of that size covers the whole file on any device.
CHUNK = 128 * 1024


def weight_files(source: str | None, cache_dir: Path | None) -> list[Path]:
    """The files the loader will read the weights of `source` from: a directory's (or the converted
    GGUF's) safetensors, or its PyTorch `.bin` files where it has none (transformers reads those
    only then); else the GGUF file itself (its first start converts it)."""
    directory = model_files_dir(source, cache_dir)
    if directory is not None:
        files = sorted(p for p in directory.iterdir() if p.is_file())
        return [p for p in files if p.suffix == ".safetensors"] or [p for p in files if p.suffix == ".bin"]
    given = Path(source) if source else default_gguf_path()
    return [given] if given.is_file() and given.suffix == ".gguf" else []


def _meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes left under the tightest cgroup v2 memory limit of the process's cgroup and its
    ancestors (None: no limit, or none readable)."""
    try:
        own = proc_cgroup.read_text()
    except OSError:
        return None
    rooms = []
    for folder in cgroup_v2_dirs(root, own):
        try:
            limit = (folder / "memory.max").read_text().strip()
            if limit != "max":
                rooms.append(max(int(limit) - int((folder / "memory.current").read_text()), 0))
        except (OSError, ValueError):
            continue
    return min(rooms) if rooms else None


def memory_left() -> int | None:
    """The memory the process may still fill: the lesser of the host's and its cgroup's (None: unknown)."""
    known = [m for m in (_meminfo_available(), _cgroup_room()) if m is not None]
    return min(known) if known else None


def prefetch(files: list[Path], room: int | None) -> int:
    """Ask the kernel to read `files` ahead; the bytes asked for (0 when they would take more than
    MEMORY_SHARE of `room`, or the platform has no fadvise)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    sizes = {f: f.stat().st_size for f in files if f.is_file()}
    total = sum(sizes.values())
    if room is not None and total > MEMORY_SHARE * room:
        log.info("weights not read ahead: %.1f GiB is more than half the %.1f GiB of memory left",
                 total / 2**30, room / 2**30)  # fmt: skip
        return 0
    asked = 0
    for f, size in sizes.items():
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            for offset in range(0, size, CHUNK):
                os.posix_fadvise(fd, offset, CHUNK, os.POSIX_FADV_WILLNEED)
            asked += size
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def start_prefetch(source: str | None, cache_dir: Path | None) -> threading.Thread:
    """prefetch() of the model's weight files in a daemon thread (the hint may block while it queues
    the reads of a large file); the caller goes on at once."""

    def run() -> None:
        try:
            files = weight_files(source, cache_dir)
            asked = prefetch(files, memory_left())
        except Exception as exc:  # only a hint: the loader says clearly what is wrong with a model
            log.debug("weights not read ahead: %s", exc)
            return
        if asked:
            log.info("reading %.2f GiB of weights ahead of the engine's imports", asked / 2**30)

    thread = threading.Thread(target=run, name="tandem-weights-prefetch", daemon=True)
    thread.start()
    return thread
