"""The served model's tokenizer as files a client can fetch (`GET /v1/models/{model}/tokenizer/{file}`,
`tandem tokenizer`): benchmark clients (guidellm, inference-perf) count tokens with the model's own
tokenizer, and the served name is no hub id they could load it by.

Only the files that make up a tokenizer are served, by the names transformers gives them: its own
vocabulary files (`vocab_files_names` of the tokenizer's class), the tokenizer, its config and
special tokens, chat templates, and the model's config.json where the tokenizer config names no
class (AutoTokenizer then reads the model type from it). A client's path is only ever looked up
among these names, never joined to a folder: nothing else of the model's folder can be reached.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from transformers.tokenization_utils_base import (
    ADDED_TOKENS_FILE,
    FULL_TOKENIZER_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_CONFIG_FILE,
)
from transformers.utils.hub import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE

TOKENIZER_FILES = (
    TOKENIZER_CONFIG_FILE,
    FULL_TOKENIZER_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    ADDED_TOKENS_FILE,
    CHAT_TEMPLATE_FILE,
    LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE,
)
MODEL_CONFIG_FILE = "config.json"


def _names_its_class(config: Path) -> bool:
    try:
        return bool(json.loads(config.read_text()).get("tokenizer_class"))
    except (OSError, ValueError, AttributeError):
        return False


def tokenizer_files(folder: Path, vocab_files: Iterable[str]) -> dict[str, Path]:
    """The files of the tokenizer in `folder`, by the relative path a client asks for. `vocab_files`:
    the file names of the tokenizer's class (`tokenizer.vocab_files_names.values()`)."""
    names = [*TOKENIZER_FILES, *vocab_files]
    if not _names_its_class(folder / TOKENIZER_CONFIG_FILE):
        names.append(MODEL_CONFIG_FILE)
    found = {name: folder / name for name in dict.fromkeys(names) if (folder / name).is_file()}
    templates = folder / CHAT_TEMPLATE_DIR
    if templates.is_dir():
        for template in sorted(templates.glob("*.jinja")):
            if template.is_file():
                found[f"{CHAT_TEMPLATE_DIR}/{template.name}"] = template
    return found
