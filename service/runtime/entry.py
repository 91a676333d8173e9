"""The targets the supervisor starts its processes with: each imports its process's code only once it
runs there, so the supervisor itself never loads torch, transformers or the gRPC servicers."""

from __future__ import annotations

from ..cache_dirs import use_compile_cache
from ..ipc.sockets import Endpoints
from ..settings import ServerSettings


def engine(
    settings: ServerSettings, endpoints: Endpoints, num_fronts: int, log_level: str, started_at: float
) -> None:
    # before torch is imported: the compiler reads where its caches are from the environment
    compile_cache = use_compile_cache(settings.cache_dir) if settings.compile_cache else None
    from .engine_process import engine_main

    engine_main(settings, endpoints, num_fronts, log_level, started_at, compile_cache)


def front(settings: ServerSettings, index: int, endpoints: Endpoints, log_level: str) -> None:
    from ..server.front import front_main

    front_main(settings, index, endpoints, log_level)
