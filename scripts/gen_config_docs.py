"""Write docs/configuration.md from the settings classes; `--check` fails if it is out of date."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.service.settings import ServerSettings

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

HEADER = """# Configuration

Every setting of `tandem serve` comes from an environment variable `TANDEM_<NAME>` or from the
flag `--<name>` (flags win over the environment). This page is generated from
`service/settings.py` by `scripts/gen_config_docs.py`; CI fails when it is out of date.

| flag | environment | default | meaning |
|---|---|---|---|
"""


def _default(value: object) -> str:
    return "unset" if value is None else f"`{value}`"


def render() -> str:
    rows = []
    for name, field in ServerSettings.model_fields.items():
        flag = ("--[no-]" if field.annotation is bool else "--") + name.replace("_", "-")
        env = f"TANDEM_{name.upper()}"
        rows.append(f"| `{flag}` | `{env}` | {_default(field.default)} | {field.description} |")
    return HEADER + "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
