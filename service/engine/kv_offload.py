"""The host pool of KV blocks, and the copies between it and the device cache (KV offload).

A preempted sequence's blocks are copied to the pool and back before it runs again, instead of
being recomputed (host_blocks.py keeps the pool's bookkeeping, the scheduler decides). On CUDA the
pool is pinned host memory and every copy is queued without a host wait:

    compute stream:  gather the blocks going out into a staging buffer   -> gathered
    offload stream:  wait gathered; copy staging -> pool (device to host)
    offload stream:  copy pool -> staging (host to device)               -> loaded
    compute stream:  wait loaded; scatter the staging buffer into the blocks coming in

Both are queued before the step's forward: a gather reads what earlier steps wrote, before this
step reuses the blocks; a scatter lands before this step reads them. The device-to-device gather
and scatter are short; the PCIe copies run on their own stream beside the steps. It is not the
step's token-copy stream: a step's tokens must never wait behind a long KV copy. One stream for
both directions keeps every use of a pool block in order (the scheduler frees a block as soon as
its copy in is queued). On the CPU the copies simply run. An FP8 cache's blocks move as their bytes
(kv_quant.as_bytes: not every device has float8 index kernels), its scales stay where they are.

Pinning the pool takes seconds for some GiB (docs/benchmarks.md), so the server pins it on a thread of
its own once the CUDA graphs are captured (a capture fails if another thread allocates meanwhile),
beside the host-bound compile and warm-up, and opens it before it serves: the pinning holds the CUDA
driver, and a step launched meanwhile would wait for it. A pool that cannot be pinned (the host's
memory, a memlock limit) is left out with a warning, and preempted sequences are recomputed.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from .ops.kv_cache import KVCache
from .ops.kv_quant import as_bytes
from .scheduler import BlockMoves
from .streams import Streams, on

log = logging.getLogger(__name__)


def _runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first pool block, first staging row, length) of each run of consecutive pool blocks."""
    runs: list[tuple[int, int, int]] = []
    for row, block in enumerate(host_ids):
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((block, row, 1))
    return runs


class KVOffload:
    def __init__(self, cache: KVCache, num_blocks: int, streams: Streams | None = None) -> None:
        self.cache = cache
        self.device = cache.k_store.device
        self.cuda = self.device.type == "cuda"
        # the block dimension of the storage viewed by block: NHD [layer, block, slot, head, dim],
        # HND [layer, head, block, slot, dim]
        self.block_dim = 2 if cache.head_major else 1
        self.k_blocks = self._by_block(as_bytes(cache.k_store))
        self.v_blocks = self._by_block(as_bytes(cache.v_store))
        block_shape = self.k_blocks.select(self.block_dim, 0).shape
        # one pool block: its K and V of every layer, contiguous, so a run of blocks is one copy
        self.shape = (num_blocks, 2, *block_shape)
        self.store: torch.Tensor | None = None  # the pool, once allocated
        self._allocating: threading.Thread | None = None
        self.compute = streams.compute if streams is not None else None
        self.stream = streams.offload if streams is not None else None

    def allocate(self, background: bool = False) -> None:
        """Allocate the pool (pinned on CUDA): now, or on a thread of its own (`ready` says when).
        Call it once no CUDA graph is being captured any more."""
        if self.store is not None or self._allocating is not None:
            return
        if not background:
            self._allocate()
            return
        self._allocating = threading.Thread(target=self._allocate, name="tandem-kv-offload-pool", daemon=True)
        self._allocating.start()

    def _allocate(self) -> None:
        start = time.perf_counter()
        try:
            store = torch.empty(self.shape, dtype=self.k_blocks.dtype, pin_memory=self.cuda)
        except (RuntimeError, MemoryError) as exc:
            log.warning("KV offload is off: the host pool of %.2f GiB could not be allocated (%s); "
                        "preempted sequences are recomputed", self.nbytes / 2**30, exc)
            return
        self.store = store
        log.info("KV offload: the host pool (%.2f GiB%s) allocated in %.2f s", self.nbytes / 2**30,
                 ", pinned" if self.cuda else "", time.perf_counter() - start)

    @property
    def nbytes(self) -> int:
        return self.k_blocks.element_size() * int(torch.Size(self.shape).numel())

    @property
    def ready(self) -> bool:
        """The pool's memory exists: its blocks may be handed out."""
        return self.store is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a pool allocated in the background; -> whether it is ready."""
        if self._allocating is not None:
            self._allocating.join(timeout)
        return self.ready

    def _by_block(self, store: torch.Tensor) -> torch.Tensor:
        bs = self.cache.block_size
        if self.cache.head_major:  # [layer, head, slot, dim]
            layers, heads, slots, dim = store.shape
            return store.view(layers, heads, slots // bs, bs, dim)
        layers, slots, heads, dim = store.shape
        return store.view(layers, slots // bs, bs, heads, dim)

    def _index(self, ids: list[int]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.int64)
        if not self.cuda:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)  # pageable would wait for the stream

    def queue(self, moves: BlockMoves) -> None:
        """Queue a step's copies (before its forward): out first, since a block going out this step
        may be the destination of one coming in."""
        store = self.store
        assert store is not None, "the scheduler hands out pool blocks only once the pool is ready"
        if moves.out_device:
            self._copy_out(store, moves.out_device, moves.out_host)
        if moves.in_host:
            self._copy_in(store, moves.in_host, moves.in_device)

    @torch.inference_mode()
    def _copy_out(self, store: torch.Tensor, device_ids: list[int], host_ids: list[int]) -> None:
        d = self.block_dim
        with on(self.compute):
            index = self._index(device_ids)
            staging = torch.empty(
                (len(device_ids), *store.shape[1:]), dtype=store.dtype, device=self.device
            )
            staging[:, 0] = self.k_blocks.index_select(d, index).movedim(d, 0)
            staging[:, 1] = self.v_blocks.index_select(d, index).movedim(d, 0)
        if not self.cuda:
            store[torch.tensor(host_ids)] = staging
            return
        gathered = torch.cuda.Event()
        gathered.record(self.compute)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(gathered)
            for first, start, length in _runs(host_ids):
                store[first : first + length].copy_(staging[start : start + length], non_blocking=True)
        staging.record_stream(self.stream)  # the allocator keeps it until the copies are done

    @torch.inference_mode()
    def _copy_in(self, store: torch.Tensor, host_ids: list[int], device_ids: list[int]) -> None:
        d = self.block_dim
        if self.cuda:
            with torch.cuda.stream(self.stream):
                staging = torch.empty(
                    (len(host_ids), *store.shape[1:]), dtype=store.dtype, device=self.device
                )
                for first, start, length in _runs(host_ids):
                    staging[start : start + length].copy_(
                        store[first : first + length], non_blocking=True
                    )
                loaded = torch.cuda.Event()
                loaded.record(self.stream)
            self.compute.wait_event(loaded)
        else:
            staging = store[torch.tensor(host_ids)]
        with on(self.compute):
            index = self._index(device_ids)
            self.k_blocks.index_copy_(d, index, staging[:, 0].movedim(0, d))
            self.v_blocks.index_copy_(d, index, staging[:, 1].movedim(0, d))
        if self.cuda:
            staging.record_stream(self.compute)
