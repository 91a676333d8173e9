"""Model loading: the embedded default, GGUF files converted once and cached, transformers dirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tandem.service.models.default_model import DEFAULT_MODEL_NAME, default_gguf_path
from tandem.service.models.loader import (
    STALE_STAGING_S,
    convert_gguf,
    default_cache_dir,
    load_model,
    remove_stale_staging,
)
from tandem.service.models.paths import model_files_dir


def _cache() -> Path:
    return Path(os.environ.get("TANDEM_TEST_CACHE", default_cache_dir()))


def test_gguf_conversion_is_cached(smol_dir):
    config = smol_dir / "config.json"
    before = config.stat().st_mtime_ns
    assert convert_gguf(default_gguf_path(), _cache()) == smol_dir
    assert config.stat().st_mtime_ns == before  # reused, not rewritten
    assert (smol_dir / "model.safetensors").is_file()


def test_the_tokenizer_is_found_where_the_engine_will_load_it_before_it_does(smol_dir, tmp_path):
    """A front loads the tokenizer beside the engine's start where its path is known already: a model
    directory, a GGUF model converted before; not one the engine has yet to convert."""
    loaded = load_model(None, None, torch.device("cpu"), cache_dir=_cache())
    assert model_files_dir(None, _cache()) == loaded.path == smol_dir
    assert model_files_dir(str(smol_dir), None) == smol_dir
    assert model_files_dir(None, tmp_path) is None  # an empty cache: the engine converts first
    assert model_files_dir(str(tmp_path / "missing"), None) is None


def test_default_model_loads_with_chat_template_and_eos(smol_dir):
    loaded = load_model(None, None, torch.device("cpu"), cache_dir=_cache())
    assert loaded.name == DEFAULT_MODEL_NAME
    assert loaded.tokenizer.chat_template
    assert loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") in loaded.eos_token_ids
    assert loaded.model.config.model_type == "llama"


def test_a_gguf_path_is_served_under_its_stem(smol_dir):
    loaded = load_model(str(default_gguf_path()), None, torch.device("cpu"), cache_dir=_cache())
    assert loaded.name == default_gguf_path().stem.lower()


def test_a_transformers_directory_and_a_name_override(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("qwen3")), "my-model", torch.device("cpu"))
    assert loaded.name == "my-model" and loaded.model.config.model_type == "qwen3"


def test_a_bad_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a transformers model directory"):
        load_model(str(tmp_path / "nowhere"), None, torch.device("cpu"))


def test_staging_folders_of_abandoned_conversions_are_removed(tmp_path):
    """A server stopped mid-conversion leaves its staging folder; the next conversion removes it
    once it is old, but never a young one (another server may be converting into the same cache)."""
    old, young, model = tmp_path / ".convert-old", tmp_path / ".convert-young", tmp_path / "model-abc"
    for folder in (old, young, model):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 1024)
    long_ago = os.stat(old).st_mtime - STALE_STAGING_S - 60
    os.utime(old, (long_ago, long_ago))
    os.utime(model, (long_ago, long_ago))
    assert remove_stale_staging(tmp_path) == [old]
    assert not old.exists() and young.is_dir() and model.is_dir()
