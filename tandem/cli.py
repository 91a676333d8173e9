"""`tandem`: one command line for the server and its tools."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import types
import typing

from pydantic import ValidationError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_settings_flags(
    parser: argparse.ArgumentParser, settings_cls: type, env_prefix: str = "TANDEM_"
) -> None:
    """One flag per setting; a flag given on the command line beats the TANDEM_ environment."""
    for name, field in settings_cls.model_fields.items():
        help_text = f"{field.description} [env {env_prefix}{name.upper()}]"
        if field.annotation is bool:
            parser.add_argument(
                _flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        choices = None
        annotation = field.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # `Literal[...] | None`
            options = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = options[0] if len(options) == 1 else annotation
        if typing.get_origin(annotation) is typing.Literal:
            choices = typing.get_args(annotation)
        parser.add_argument(_flag(name), dest=name, default=None, choices=choices, help=help_text)


def _settings_from(args: argparse.Namespace, settings_cls: type) -> object:
    given = {k: v for k, v in vars(args).items() if k in settings_cls.model_fields and v is not None}
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        sys.exit(f"tandem: invalid settings:\n{exc}")


def _serve(args: argparse.Namespace) -> int:
    from tandem.service.runtime.supervisor import serve
    from tandem.service.settings import ServerSettings

    return serve(_settings_from(args, ServerSettings), args.log_level)


def _health(args: argparse.Namespace) -> int:
    from tandem import connect
    from tandem.health import run

    try:
        creds = connect.credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    except (OSError, ValueError) as exc:
        sys.exit(f"tandem health: {exc}")
    return run(args.target, args.service, args.timeout, creds, args.tls_server_name)


def _generate(args: argparse.Namespace) -> int:
    from tandem.service.client import generate_to_terminal

    return asyncio.run(generate_to_terminal(args))


def _tokenizer(args: argparse.Namespace) -> int:
    from tandem.tokenizer_fetch import run

    return run(args.server, args.folder, args.model, args.token_file, args.tls_ca_file, args.tls_cert_file,
               args.tls_key_file)  # fmt: skip


def _operator(args: argparse.Namespace) -> int:
    from tandem.operator.main import main as run_operator
    from tandem.operator.settings import OperatorSettings

    return run_operator(_settings_from(args, OperatorSettings))


def _bench(args: argparse.Namespace) -> int:
    from tandem.bench import run

    return run(args.name, args.bench_args)


def _add_connection_flags(parser: argparse.ArgumentParser, token: bool = True) -> None:
    parser.add_argument("--tls-ca-file", help="connect with TLS, trusting this PEM CA (default: plaintext)")
    parser.add_argument("--tls-cert-file", help="mutual TLS: this client's PEM certificate chain")
    parser.add_argument("--tls-key-file", help="mutual TLS: this client's PEM private key")
    parser.add_argument("--tls-server-name", help="the name to check the server's certificate for")
    if token:
        parser.add_argument("--token-file", help="send the bearer token in this file (its first token line)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM model server")
    sub = parser.add_subparsers(dest="command", required=True)

    from tandem.service.settings import ServerSettings

    serve = sub.add_parser("serve", help="run the gRPC model server")
    _add_settings_flags(serve, ServerSettings)
    serve.add_argument("--log-level", default="INFO")
    serve.set_defaults(func=_serve)

    health = sub.add_parser(
        "health", help="exit 0 if a server's grpc.health.v1 Check says SERVING (for probes and helm test)"
    )
    health.add_argument("--target", default="localhost:50051", help="host:port of the gRPC server")
    health.add_argument("--service", default="", help="service name to check; empty = the whole server")
    health.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    _add_connection_flags(health, token=False)
    health.add_argument("--log-level", default="WARNING")
    health.set_defaults(func=_health)

    gen = sub.add_parser("generate", help="stream an answer from a running server to the terminal")
    gen.add_argument("prompt", help="the user message (or the raw prompt with --raw)")
    gen.add_argument("--server", default="localhost:50051")
    gen.add_argument("--raw", action="store_true", help="send the prompt as raw text, no chat template")
    gen.add_argument("--system", default=None, help="a system message before the prompt")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--cache-salt", default=None,
                     help="share cached prompt prefixes only with requests of this salt (docs/api.md)")
    gen.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    _add_connection_flags(gen)
    gen.add_argument("--log-level", default="WARNING")
    gen.set_defaults(func=_generate)

    tok = sub.add_parser(
        "tokenizer",
        help="fetch the served model's tokenizer files into a folder (for AutoTokenizer.from_pretrained, "
        "guidellm --processor)",
    )
    tok.add_argument("folder", help="where the files go (created if missing)")
    tok.add_argument("--server", default="http://localhost:8000", help="the server's HTTP API (--http-port)")
    tok.add_argument("--model", default=None, help="the served model's name (default: the one served)")
    tok.add_argument("--tls-ca-file", help="connect with TLS (an https:// server), trusting this PEM CA")
    tok.add_argument("--tls-cert-file", help="mutual TLS: this client's PEM certificate chain")
    tok.add_argument("--tls-key-file", help="mutual TLS: this client's PEM private key")
    tok.add_argument("--token-file", help="send the bearer token in this file (its first token line)")
    tok.add_argument("--log-level", default="WARNING")
    tok.set_defaults(func=_tokenizer)

    from tandem.operator.settings import ENV_PREFIX, OperatorSettings

    op = sub.add_parser("operator", help="run the Kubernetes operator for ModelServer resources")
    _add_settings_flags(op, OperatorSettings, ENV_PREFIX)
    op.set_defaults(func=_operator)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark (gpu: engine vs transformers with the roofline; serve: the server vs the "
        "engine alone; soak; cpu; autoscale; workloads: mixed, shared-prefix, oversubscribed and "
        "long-generation workloads; host: the engine's host work per step; offload-bound: what KV "
        "offload can gain over recompute; gpu-profile, cpu-profile, kernel-resources; timeline: draw "
        "`bench gpu --timeline`'s trace)",
        description="Arguments after NAME go to the benchmark: `tandem bench gpu --help` lists them. "
        "Results go to bench/results/ in a source checkout, else the current directory.",
    )
    from tandem.bench import BENCHMARKS

    bench.add_argument("name", choices=sorted(BENCHMARKS), nargs="?", default="gpu")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.add_argument("--log-level", default="WARNING")
    bench.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    from tandem.service.runtime.child import LOG_FORMAT  # the standard library only

    logging.basicConfig(level=(args.log_level or "INFO").upper(), format=LOG_FORMAT)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
