"""Write docs/configuration.md from the settings classes; `--check` fails if it is out of date."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.operator.settings import ENV_PREFIX as OPERATOR_ENV_PREFIX
from tandem.operator.settings import OperatorSettings
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
    if value == "":
        return "empty"
    return "unset" if value is None else f"`{value}`"


OPERATOR_HEADER = """
## Operator

`tandem operator` (docs/operator.md) reads `TANDEM_OPERATOR_<NAME>` or the flag `--<name>`;
generated from `operator/settings.py`.

| flag | environment | default | meaning |
|---|---|---|---|
"""


def _rows(settings_cls: type, env_prefix: str) -> list[str]:
    rows = []
    for name, field in settings_cls.model_fields.items():
        flag = ("--[no-]" if field.annotation is bool else "--") + name.replace("_", "-")
        env = f"{env_prefix}{name.upper()}"
        rows.append(f"| `{flag}` | `{env}` | {_default(field.default)} | {field.description} |")
    return rows


def render() -> str:
    server = "\n".join(_rows(ServerSettings, "TANDEM_")) + "\n"
    operator = "\n".join(_rows(OperatorSettings, OPERATOR_ENV_PREFIX)) + "\n"
    return HEADER + server + OPERATOR_HEADER + operator


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
