"""`tandem generate`: a small streaming client for humans."""

from __future__ import annotations

import argparse
import sys

import grpc

from tandem import connect
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    if args.raw:
        req.text = args.prompt
    else:
        if args.system:
            req.chat.messages.add(role="system", content=args.system)
        req.chat.messages.add(role="user", content=args.prompt)
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(req.sampling, name, value)
    if args.max_tokens is not None:
        req.stopping.max_tokens = args.max_tokens
    req.stopping.stop.extend(args.stop)
    if args.cache_salt is not None:
        req.cache_salt = args.cache_salt
    return req


async def generate_to_terminal(args: argparse.Namespace) -> int:
    try:
        creds = connect.credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
        metadata = connect.token_metadata(args.token_file)
    except (OSError, ValueError) as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    options = connect.server_name_option(args.tls_server_name)
    async with connect.aio_channel(args.server, creds, options) as channel:
        stub = pb_grpc.TandemStub(channel)
        try:
            call = stub.GenerateStream(build_request(args), timeout=args.timeout, metadata=metadata)
            async for msg in call:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    reason = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
                    sys.stdout.write("\n")
                    u = msg.usage
                    print(
                        f"[{reason}; {u.prompt_tokens} prompt ({u.cached_prompt_tokens} cached) + "
                        f"{u.completion_tokens} completion tokens]",
                        file=sys.stderr,
                    )
        except grpc.aio.AioRpcError as err:
            print(f"\ntandem: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0
