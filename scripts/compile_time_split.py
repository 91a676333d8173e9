"""Where a torch.compile of a model's decode forward spends its time, with the compile cache empty
and filled: Dynamo's bytecode tracing against Inductor's code generation (or its FX-graph cache),
for each compile scope (service/engine/compile_scope.py): the whole model, or one decoder layer
that every layer runs.

The compile cache (service/cache_dirs.py) keeps Inductor's and Triton's artefacts; Dynamo traces the
Python forward again in every new process. Tracing grows with the model's layers, not its width,
so the embedded 30-layer model on the CPU shows the split an 8B model (32 layers) has.

    python scripts/compile_time_split.py     # each scope: a fresh cache, cold then warm, in new processes
    python scripts/compile_time_split.py --scopes layer --cache-dir DIR --batches 8,4,2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Dynamo's and Inductor's own timers (torch._dynamo.utils.compile_times), seconds over the process
TIMERS = {"bytecode_tracing": "dynamo_tracing_s", "OutputGraph.call_user_compiler": "backend_s",
          "_compile.compile_inner": "compile_total_s"}  # fmt: skip


def one_process(cache_dir: Path, batches: list[int], scope: str) -> dict:
    """In this process: compile the embedded model's forward over `scope` at each batch of one token."""
    from tandem.service.cache_dirs import use_compile_cache

    use_compile_cache(cache_dir)
    import torch
    from torch._dynamo.utils import compile_times, counters

    from tandem.service.engine.compile_scope import compile_forward
    from tandem.service.models.loader import load_model

    model = load_model(None, None, torch.device("cpu"), "float32").model
    compiled = compile_forward(model, scope, "inductor")
    firsts = {}
    with torch.inference_mode():
        for b in batches:
            start = time.perf_counter()
            compiled(input_ids=torch.randint(0, 1000, (b, 1)), use_cache=False)
            firsts[b] = round(time.perf_counter() - start, 2)
    lines = (line.rsplit(",", 1) for line in compile_times(repr="str", aggregate=True).splitlines())
    timers = {key.strip(): value for key, value in (pair for pair in lines if len(pair) == 2)}
    out = {name: round(float(timers.get(key, 0.0)), 2) for key, name in TIMERS.items()}
    inductor = counters["inductor"]
    return {"first_call_s": firsts, **out, "frames": counters["frames"]["ok"],
            "fx_graph_cache_hits": inductor["fxgraph_cache_hit"],
            "fx_graph_cache_misses": inductor["fxgraph_cache_miss"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", type=Path,
                    help="the compile caches' parent, a folder per scope (default: a new temporary dir)")
    ap.add_argument("--batches", default="8,4,2", help="decode batch sizes, compiled in this order")
    ap.add_argument("--scopes", default="model,layer", help="compile scopes, comma-separated: model, layer")
    ap.add_argument("--one", metavar="SCOPE", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        print(json.dumps(one_process(args.cache_dir, batches, args.one)))
        return
    parent = args.cache_dir or Path(tempfile.mkdtemp(prefix="tandem-compile-"))
    for scope in args.scopes.split(","):
        cache = parent / scope  # each scope's cold run starts from nothing
        for name in ("cold", "warm"):  # each a new process: what a new pod does
            command = [sys.executable, __file__, "--one", scope, "--cache-dir", str(cache),
                       "--batches", args.batches]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            print(scope, name, json.loads(done.stdout.strip().splitlines()[-1]), flush=True)


if __name__ == "__main__":
    main()
