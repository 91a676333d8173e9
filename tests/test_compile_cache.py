"""Compiled artefacts kept under cache_dir/compile/: a second process compiles nothing the first
compiled; an unwritable directory leaves the compiler its defaults; an engine whose start-up fails
with artefacts in use sets them aside and is started once more without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.service.cache_dirs import (
    COMPILE_CACHE_UNUSABLE_EXIT,
    compile_cache_dir,
    set_aside,
    use_compile_cache,
)

CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
                   "TORCHINDUCTOR_AUTOGRAD_CACHE")

# a process that compiles one function with the compile cache under argv[1]: prints hits and misses
COMPILE = """
import sys
from pathlib import Path
from tandem.service.cache_dirs import use_compile_cache
root, said = use_compile_cache(Path(sys.argv[1]))
import torch
from torch._dynamo.utils import counters
torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1)(torch.randn(64))
print(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


def _compile(cache_dir: Path) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    out = subprocess.run([sys.executable, "-c", COMPILE, str(cache_dir)], check=True, capture_output=True,
                         text=True, timeout=300, env=env).stdout.split()
    return int(out[-2]), int(out[-1])


def test_the_compilers_caches_go_under_the_cache_dir_named_by_the_torch_version(tmp_path, monkeypatch):
    import torch

    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    root, said = use_compile_cache(tmp_path)
    assert root == compile_cache_dir(tmp_path) and root.is_dir() and str(root) in said
    assert root.parent == tmp_path / "compile" and torch.__version__.replace("+", "_") in root.name
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")


def test_a_cache_dir_that_cannot_be_written_leaves_the_compiler_its_defaults(tmp_path, monkeypatch):
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    root, said = use_compile_cache(blocker)  # its compile/ cannot be made under a file
    assert root is None and "not writable" in said
    assert not any(name in os.environ for name in CACHE_VARIABLES)


def test_a_second_process_finds_what_the_first_compiled_and_a_set_aside_cache_compiles_afresh(tmp_path):
    assert _compile(tmp_path) == (0, 1)
    assert _compile(tmp_path) == (1, 0)
    aside = set_aside(compile_cache_dir(tmp_path))
    assert aside is not None and aside.is_dir() and ".unusable-" in aside.name
    assert not compile_cache_dir(tmp_path).exists()
    assert _compile(tmp_path) == (0, 1)


def test_an_engine_that_fails_with_artefacts_in_use_starts_once_more_without_them(tmp_path):
    """A fault that is not the artefacts' (here a model whose config.json is not JSON) fails the
    second start too: the pod stops with the error, after exactly one more start."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    cache = tmp_path / "cache"
    tandem = Path(sys.executable).with_name("tandem")
    command = [str(tandem), "serve", "--model", str(model), "--cache-dir", str(cache), "--port", "0",
               "--http-port", "0", "--metrics-port", "0"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    log = proc.stderr
    assert log.count("the start-up failed (with compiled artefacts from") == 1
    assert log.count("started again") == 1 and "starting again without them" in log
    assert "JSONDecodeError" in log and "the engine process ended before the model was ready" in log
    (aside,) = (cache / "compile").iterdir()
    assert ".unusable-" in aside.name
    assert COMPILE_CACHE_UNUSABLE_EXIT not in (0, 1)


@pytest.mark.parametrize("missing", [True, False])
def test_set_aside_says_where_the_artefacts_went_or_that_they_could_not_move(tmp_path, missing):
    root = tmp_path / "compile" / "torch-x"
    if not missing:
        root.mkdir(parents=True)
    aside = set_aside(root)
    assert (aside is None) == missing
