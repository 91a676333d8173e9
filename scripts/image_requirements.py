"""What the container images install besides the tandem wheel, from pyproject.toml.

  python scripts/image_requirements.py operator   # runtime deps minus the model-serving stack
  python scripts/image_requirements.py server     # runtime deps minus torch (the base image's CUDA build)

The Dockerfile runs it in its build stage, so the images follow pyproject.toml without a copy.
Standard library only: it runs on a bare python image.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# Provided by the CUDA PyTorch base image of the server; a pip-installed torch would be a second copy.
# torch, and triton, which CUDA builds of torch require (xgrammar asks for it too: never replace the image's)
BASE_IMAGE_PROVIDES = frozenset({"torch", "triton"})
# Only the model server loads models; the operator image (and `tandem health`) never imports these.
MODEL_SERVING = frozenset({"torch", "transformers", "gguf", "accelerate", "compressed-tensors"})


def requirement_name(requirement: str) -> str:
    """The normalised project name of a PEP 508 requirement string (PEP 503 normalisation)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def runtime_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def image_requirements(target: str, pyproject: Path = PYPROJECT) -> list[str]:
    excluded = MODEL_SERVING if target == "operator" else BASE_IMAGE_PROVIDES
    return [r for r in runtime_requirements(pyproject) if requirement_name(r) not in excluded]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=["server", "operator"])
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    args = parser.parse_args()
    print("\n".join(image_requirements(args.target, args.pyproject)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
