"""The Dockerfile, read by a real parser (dockerfile-parse): stages, pinned bases, non-root users,
entrypoints that are real `tandem` subcommands, what the images install. No Docker engine here:
what it copies and runs is checked against the repo, the CLI and the chart instead of by a build."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import tomllib
import yaml
from dockerfile_parse import DockerfileParser
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_image_constraints  # noqa: E402
from image_requirements import image_requirements, requirement_name, runtime_requirements  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CHART_VALUES = yaml.safe_load((ROOT / "charts/tandem/values.yaml").read_text())
MODEL_STACK = ("torch", "transformers", "gguf", "accelerate", "compressed-tensors")  # project names
MODEL_IMPORTS = tuple(name.replace("-", "_") for name in MODEL_STACK)  # ... as modules import them


def parse() -> DockerfileParser:
    return DockerfileParser(str(ROOT / "Dockerfile"))


def stages() -> dict[str, list[dict]]:
    """Instructions of each named stage, with ARG defaults of the global scope substituted in FROM."""
    args: dict[str, str] = {}
    result: dict[str, list[dict]] = {}
    current: list[dict] | None = None
    for item in parse().structure:
        kind, value = item["instruction"], item["value"]
        if kind == "ARG" and current is None:
            name, _, default = value.partition("=")
            args[name] = default
        elif kind == "FROM":
            image, _, name = value.partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image.strip())
            current = [{"instruction": "FROM", "value": image}]
            result[name.strip()] = current
        elif current is not None and kind != "COMMENT":
            current.append(item)
    return result


def instructions(stage: str, kind: str) -> list[str]:
    return [i["value"] for i in stages()[stage] if i["instruction"] == kind]


def exec_form(value: str) -> list[str]:
    return yaml.safe_load(value)  # a JSON array is YAML too


def tandem(*args: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run the `tandem` CLI as a fresh process, with some libraries made unimportable if asked."""
    code = (
        "import sys\n"
        f"for name in {block!r}:\n"
        "    sys.modules[name] = None\n"
        "from tandem.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd="/", timeout=60
    )


def test_three_stages_build_the_wheel_then_server_and_operator() -> None:
    assert list(stages()) == ["wheel", "server", "operator"]
    for stage in ("server", "operator"):
        copies = instructions(stage, "COPY")
        assert copies == ["--from=wheel /dist /dist"], "runtime stages take only the built wheel"


def test_base_images_are_pinned() -> None:
    server_base = stages()["server"][0]["value"]
    pinned_pytorch = r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime"
    assert re.fullmatch(pinned_pytorch, server_base), server_base
    for stage in ("wheel", "operator"):
        base = stages()[stage][0]["value"]
        assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base), base


def test_every_pip_install_is_pinned() -> None:
    for stage in stages():
        for run in instructions(stage, "RUN"):
            for command in run.split("&&"):
                words = shlex.split(command)
                if words[:4] != ["python", "-m", "pip", "install"]:
                    continue
                packages = [w for w in words[4:] if not w.startswith("-")]
                options = [w for w in words[4:] if w.startswith("-")]
                if "-r" in options:
                    assert "-c" in options and "/dist/constraints.txt" in words, command
                    continue
                for package in packages:
                    pinned = re.fullmatch(r"[\w.-]+==[\w.]+", package)
                    assert pinned or package.startswith("/dist/tandem-"), f"unpinned: {package} in {command}"


def test_constraints_pin_every_runtime_dependency_within_its_range() -> None:
    assert gen_image_constraints.problems() == []
    pins = gen_image_constraints.read_pins()
    assert "torch" not in pins, "torch comes from the base image's CUDA build"


def test_image_requirements_split() -> None:
    runtime = {requirement_name(r) for r in runtime_requirements()}
    server = {requirement_name(r) for r in image_requirements("server")}
    operator = {requirement_name(r) for r in image_requirements("operator")}
    assert server == runtime - {"torch"}
    assert operator == runtime - set(MODEL_STACK)
    assert {"grpcio", "grpcio-health-checking", "pydantic-settings"} <= operator


def test_runtime_stages_run_as_the_charts_non_root_user() -> None:
    uid = CHART_VALUES["podSecurityContext"]["runAsUser"]
    gid = CHART_VALUES["podSecurityContext"]["runAsGroup"]
    for stage in ("server", "operator"):
        users = instructions(stage, "USER")
        assert users, f"{stage} has no USER"
        assert users[-1] == f"{uid}:{gid}", "numeric, so runAsNonRoot can verify it"
        assert uid != 0
        (run,) = instructions(stage, "RUN")
        assert f"useradd --uid {uid} --gid {gid}" in run


def test_entrypoints_are_the_tandem_cli() -> None:
    assert PYPROJECT["project"]["scripts"]["tandem"] == "tandem.cli:main"
    assert exec_form(instructions("server", "ENTRYPOINT")[-1]) == ["tandem"]
    assert exec_form(instructions("operator", "ENTRYPOINT")[-1]) == ["tandem"]
    assert exec_form(instructions("server", "CMD")[-1]) == ["serve"]
    assert exec_form(instructions("operator", "CMD")[-1]) == ["operator"]


def test_server_command_is_a_real_subcommand() -> None:
    (command,) = exec_form(instructions("server", "CMD")[-1])
    result = tandem(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout


def test_operator_command_is_a_real_subcommand_without_the_model_stack() -> None:
    (command,) = exec_form(instructions("operator", "CMD")[-1])
    result = tandem(command, "--help", block=MODEL_IMPORTS)
    if result.returncode == 2 and "invalid choice" in result.stderr:
        pytest.skip("`tandem operator` is not in this tree's CLI")
    assert result.returncode == 0, result.stderr


def test_operator_package_imports_without_the_model_stack() -> None:
    """The slim image has no torch: every module of tandem.operator must import without it."""
    code = (
        "import sys, pkgutil, importlib\n"
        f"for name in {MODEL_IMPORTS!r}:\n"
        "    sys.modules[name] = None\n"
        "import tandem.operator as op\n"
        "for m in pkgutil.walk_packages(op.__path__, 'tandem.operator.'):\n"
        "    importlib.import_module(m.name)\n"
        "import tandem.health\n"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert result.returncode == 0, result.stderr


@pytest.fixture()
def serving_health() -> Iterator[int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(None)


def test_server_healthcheck_runs_tandem_health(serving_health: int) -> None:
    (healthcheck,) = instructions("server", "HEALTHCHECK")
    argv = exec_form(healthcheck.split("CMD", 1)[1])
    assert argv[:2] == ["tandem", "health"]
    from tandem.service.settings import ServerSettings

    port = ServerSettings.model_fields["port"].default
    assert f"localhost:{port}" in argv
    # the same command, pointed at a live health service instead of the pod's own port
    argv = [a.replace(f"localhost:{port}", f"127.0.0.1:{serving_health}") for a in argv]
    result = tandem(*argv[1:], block=MODEL_IMPORTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_exposed_ports_match_the_server() -> None:
    from tandem.service.settings import ServerSettings

    fields = ServerSettings.model_fields
    ports = [fields[name].default for name in ("port", "http_port", "metrics_port")]
    assert instructions("server", "EXPOSE") == [" ".join(str(p) for p in ports)]


def test_operator_image_exposes_liveness_and_the_charts_metrics_port() -> None:
    from tandem.operator.settings import OperatorSettings

    liveness = OperatorSettings.model_fields["liveness_port"].default
    metrics = yaml.safe_load((ROOT / "charts" / "tandem" / "values.yaml").read_text())["operator"]["metrics"]
    assert instructions("operator", "EXPOSE") == [f"{liveness} {metrics['port']}"]


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)


def test_build_context_has_what_the_wheel_stage_copies() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert _ignored(".venv", patterns) and _ignored(".git", patterns)
    sources = []
    for copy in instructions("wheel", "COPY"):
        sources += copy.split()[:-1]
    # the package's own directories and the readme pyproject.toml names
    needed = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()) | {
        "pyproject.toml",
        PYPROJECT["project"]["readme"],
    }
    assert needed <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not _ignored(source, patterns), f"{source} is excluded by .dockerignore"


def test_every_package_directory_is_in_the_wheel() -> None:
    """The image installs the wheel, whose packages pyproject lists one by one: a new package
    directory left off that list would import in an editable checkout and be missing from the
    image."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for name, directory in setuptools["package-dir"].items():
        for init in (ROOT / directory).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / directory).parts
            package = ".".join((name, *parts))
            assert package in listed, f"{init.parent} ({package}) is not among pyproject's packages"
