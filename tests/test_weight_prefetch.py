"""Weights read ahead of the engine's imports (service/models/prefetch.py): on a real file of a real
filesystem, evicted from the page cache first, the hints bring all of it back in (mincore says
which pages are resident); a model that would take too much of the memory left is not read; the
files are those the loader reads."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import pytest

from tandem.bench.serve.start import evict
from tandem.service.models import prefetch
from tandem.service.models.default_model import default_gguf_path

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")

PAGE = mmap.PAGESIZE
SIZE = 48 << 20  # more than one readahead window of any device, by far


def resident_share(path: Path) -> float:
    """The share of `path`'s pages in the page cache (mincore over a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    int_ = ctypes.c_int
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, int_, int_, int_, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = (size + PAGE - 1) // PAGE
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / pages


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with open(model / "model.safetensors", "wb") as f:
        f.write(os.urandom(SIZE))
    return model


def test_the_hints_bring_an_evicted_file_back_into_the_page_cache(weights: Path) -> None:
    file = weights / "model.safetensors"
    evict([file])
    if resident_share(file) > 0.1:
        pytest.skip("this filesystem keeps its files in memory (nothing to evict)")
    assert prefetch.weight_files(str(weights), None) == [file]
    assert prefetch.prefetch([file], room=None) == SIZE
    deadline = time.monotonic() + 20.0
    while resident_share(file) < 0.99 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident_share(file) >= 0.99  # one hint for the whole file would have read a window of it


def test_a_model_that_would_fill_the_memory_left_is_not_read_ahead(weights: Path) -> None:
    file = weights / "model.safetensors"
    evict([file])
    if resident_share(file) > 0.1:
        pytest.skip("this filesystem keeps its files in memory (nothing to evict)")
    assert prefetch.prefetch([file], room=SIZE) == 0  # more than half of it
    time.sleep(0.5)
    assert resident_share(file) < 0.5


def test_the_files_are_those_the_loader_reads(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert prefetch.weight_files(str(gguf), tmp_path / "cache") == [gguf]  # not converted yet
    assert prefetch.weight_files(str(tmp_path / "missing"), None) == []
    pytorch = tmp_path / "pytorch"
    pytorch.mkdir()
    (pytorch / "config.json").write_text("{}")
    (pytorch / "pytorch_model.bin").write_bytes(b"0")
    assert prefetch.weight_files(str(pytorch), None) == [pytorch / "pytorch_model.bin"]
    (pytorch / "model.safetensors").write_bytes(b"0")  # transformers reads these when there are some
    assert prefetch.weight_files(str(pytorch), None) == [pytorch / "model.safetensors"]
    default = prefetch.weight_files(None, tmp_path / "empty-cache")
    assert default == [default_gguf_path()]  # the embedded model, before its first conversion


def test_memory_left_is_known_on_linux() -> None:
    left = prefetch.memory_left()
    assert left is not None and left > 0


def test_the_room_is_under_the_tightest_memory_limit_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    pod = tmp_path / "kubepods" / "pod1"
    own = pod / "server"
    own.mkdir(parents=True)
    (own / "memory.max").write_text("max\n")
    (own / "memory.current").write_text(f"{1 << 30}\n")
    (pod / "memory.max").write_text(f"{8 << 30}\n")  # the pod's limit
    (pod / "memory.current").write_text(f"{3 << 30}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/server\n")
    assert prefetch._cgroup_room(tmp_path, proc) == 5 << 30
    (pod / "memory.max").write_text("max\n")
    assert prefetch._cgroup_room(tmp_path, proc) is None  # no limit anywhere
