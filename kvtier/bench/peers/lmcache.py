"""LMCache's CPU backend as a peer of `kvtier bench peers`, when LMCache is importable here.

LMCache keeps its CPU tier inside the engine process (``LocalCPUBackend``, the L1 of its
StorageManager): no socket and no second process, so its figures are the cost of an in-process
library, the floor any daemon's IPC sits above. The bench drives one backend from ``clients``
threads (in vLLM each worker process has its own; one shared arena is LMCache's best case, and
the copies are torch ``copy_``, which releases the GIL), the way LMCache's cache engine drives it
(checked against LMCache 0.5.6's source):

  * save, per call: ``allocate`` one ``MemoryObj`` per block from the backend's allocator ->
    copy the payload in (the engine's ``batched_from_gpu``) -> ``batched_submit_put_task`` ->
    ``ref_count_down`` (the backend holds its own reference now, as ``StorageManager.batched_put``
    leaves it);
  * load, per call: ``batched_get_blocking`` (each object comes back with one more reference) ->
    copy out (the engine's ``batched_to_gpu``) -> ``ref_count_down``.

The allocator is the one ``LocalCPUBackend.initialize_allocator`` builds by default, a
``MixedMemoryAllocator`` arena; without CUDA LMCache allocates it as plain page-aligned memory
(nothing is pinned). Blocks are ``KV_2LTD`` objects, the engine's format ``[2, layers, tokens,
hidden]``: one layer of a 256-token chunk (LMCache's default chunk size) as uint8, ``size`` bytes.

LMCache's API moves between releases (key fields, allocator arguments), so setting up is checked
by a round trip of one block; anything that fails turns into a note (``reason``), never a crash.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.bench.peers.pool import RunFigures
from kvtier.bench.report import quantile

SLACK = 16 << 20  # arena bytes beyond what the bench holds: the probe block and 4 KiB rounding
CHUNK_TOKENS = 256  # LMCache's default chunk_size


@dataclass(slots=True)
class LMCacheProbe:
    """The backend (None when unusable here), why not, and the name the rows give it."""

    backend: Any
    reason: str
    name: str = "LMCache LocalCPUBackend (in-process)"

    def runner(self, ns_id: bytes, clients: int, size: int, blocks: int,
               per_call: int) -> Callable[[], dict[str, RunFigures]]:
        """One run (save then load, then an untimed delete) of ``clients`` threads."""
        assert self.backend is not None, "runner() of a usable backend only"
        return _Workload(self.backend, ns_id, clients, size, blocks, per_call).once

    def close(self) -> None:
        """Drop what the backend holds and free its arena (a no-op when there is none)."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None


def open_backend(capacity: int) -> LMCacheProbe:
    """Set up a CPU backend able to hold ``capacity`` bytes of blocks, or say why it cannot be here."""
    # LMCache logs at INFO to stderr from import on; the bench's own progress lines are what a
    # reader wants there. Its warnings (memory pressure) still show; LMCACHE_LOG_LEVEL overrides.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    # LMCache's usage telemetry is on by default (a POST to its vendor); only its cache engine
    # sends it, which the bench never builds, but a benchmark must not phone home by accident.
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    try:
        import lmcache
    except ImportError as exc:
        return LMCacheProbe(None, f"LMCache is not importable here ({exc})")
    version = getattr(lmcache, "__version__", "?")
    backend: _Backend | None = None
    try:
        backend = _Backend(capacity + SLACK)
        backend.round_trip()
    except Exception as exc:  # noqa: BLE001 - API drift between releases, a missing dependency: a note
        if backend is not None:
            backend.close()
        return LMCacheProbe(None, f"LMCache {version} is importable but its CPU backend could not be "
                                  f"set up here: {type(exc).__name__}: {exc}")
    return LMCacheProbe(backend, "", f"LMCache {version} LocalCPUBackend (in-process)")


class _Backend:
    """The few calls of LMCache's LocalCPUBackend the workload needs."""

    def __init__(self, capacity: int) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import (
            MixedMemoryAllocator,
        )
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.torch = torch
        self.key_cls = CacheEngineKey
        self.fmt = MemoryFormat.KV_2LTD
        config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_TOKENS, local_cpu=True,
                                                   max_local_cpu_size=capacity / 2**30)
        # What initialize_allocator(config, metadata) builds when NUMA, hugepages and P2P are off;
        # passing it in spares the engine metadata (model shapes) the bench has no use for.
        self.allocator = MixedMemoryAllocator(capacity, numa_mapping=None, config=config)
        self.backend = LocalCPUBackend(config, memory_allocator=self.allocator)

    def key(self, chunk_hash: bytes) -> Any:
        return self.key_cls(model_name="kvtier-bench", world_size=1, worker_id=0,
                            chunk_hash=int.from_bytes(chunk_hash[:8], "little"), dtype=self.torch.uint8)

    def shape(self, size: int) -> Any:
        """``[2, 1, tokens, hidden]`` holding ``size`` bytes (an odd size rounds up by one): LMCache
        reads the token count off the shape (``get_num_tokens``), so a flat ``[size]`` object
        breaks its bookkeeping (``clear`` raises IndexError)."""
        tokens = CHUNK_TOKENS if size % (2 * CHUNK_TOKENS) == 0 else 1
        return self.torch.Size([2, 1, tokens, -(-size // (2 * tokens))])

    def put(self, keys: list[Any], payloads: list[Any]) -> None:
        """One engine store of these blocks (see the module docstring)."""
        objs = []
        for payload in payloads:
            # eviction off: the arena is sized to hold every block of a run, and an eviction would
            # drop a block this run is about to load back
            obj = self.backend.allocate(self.shape(payload.numel()), self.torch.uint8,
                                        fmt=self.fmt, eviction=False, busy_loop=False)
            if obj is None:
                for o in objs:
                    o.ref_count_down()
                raise RuntimeError("LMCache CPU arena full (the bench sized it too small)")
            obj.tensor.view(-1)[:payload.numel()].copy_(payload)
            objs.append(obj)
        self.backend.batched_submit_put_task(keys, objs)
        for obj in objs:
            obj.ref_count_down()

    def get_into(self, keys: list[Any], dsts: list[Any]) -> None:
        """One engine retrieve of these blocks into ``dsts``."""
        objs = self.backend.batched_get_blocking(keys)
        try:
            if any(obj is None for obj in objs):
                raise RuntimeError("LMCache CPU backend lost a block")
            for obj, dst in zip(objs, dsts):
                dst.copy_(obj.tensor.view(-1)[:dst.numel()])
        finally:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()

    def remove(self, keys: list[Any]) -> None:
        self.backend.batched_remove(keys)

    def held(self) -> int:
        """Blocks in the backend's hot cache now."""
        return len(self.backend.get_keys())

    def close(self) -> None:
        self.backend.clear()  # returns every block to the arena before the arena goes
        self.allocator.close()

    def round_trip(self) -> None:
        # an odd size: the probe also covers a block that does not fill its KV shape
        src = self.torch.arange(4097, dtype=self.torch.int64).to(self.torch.uint8)
        dst = self.torch.zeros_like(src)
        key = self.key(hashlib.sha256(b"kvtier bench peers lmcache probe").digest())
        self.put([key], [src])
        self.get_into([key], [dst])
        self.remove([key])
        if not self.torch.equal(src, dst):
            raise RuntimeError("a block came back different")
        if self.held() != 0:
            raise RuntimeError("a removed block is still held")


class _Workload:
    def __init__(self, backend: _Backend, ns_id: bytes, clients: int, size: int, blocks: int, per_call: int) -> None:
        torch = backend.torch
        self.backend = backend
        self.clients = clients
        self.per_call = per_call
        gen = torch.Generator().manual_seed(size)
        self.keys = [[backend.key(hashlib.sha256(ns_id + bytes([c]) + i.to_bytes(8, "little")).digest())
                      for i in range(blocks)] for c in range(clients)]
        self.srcs = [[torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _ in range(blocks)]
                     for _ in range(clients)]
        self.dsts = [[torch.empty(size, dtype=torch.uint8) for _ in range(blocks)] for _ in range(clients)]
        self.size = size

    def _timed(self, op: str) -> RunFigures:
        spans: list[tuple[float, float]] = []
        lat: list[float] = []
        errors: list[BaseException] = []
        lock = threading.Lock()
        start = threading.Barrier(self.clients)

        def client(c: int) -> None:
            keys, srcs, dsts = self.keys[c], self.srcs[c], self.dsts[c]
            mine: list[float] = []
            try:
                start.wait()
                t0 = time.monotonic()
                for lo in range(0, len(keys), self.per_call):
                    hi = min(len(keys), lo + self.per_call)
                    s = time.monotonic()
                    if op == "save":
                        self.backend.put(keys[lo:hi], srcs[lo:hi])
                    else:
                        self.backend.get_into(keys[lo:hi], dsts[lo:hi])
                    mine.append((time.monotonic() - s) * 1e3)
                t1 = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
                start.abort()  # the others must not wait at the barrier for a dead client
                with lock:
                    errors.append(exc)
                return
            with lock:
                spans.append((t0, t1))
                lat.extend(mine)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        if real or errors:
            raise RuntimeError(f"an LMCache client thread failed during {op}") from (real or errors)[0]
        window = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
        total = self.clients * len(self.keys[0]) * self.size
        return RunFigures(total / window / 1e9, quantile(lat, 0.5), quantile(lat, 0.99), len(lat))

    def once(self) -> dict[str, RunFigures]:
        out = {op: self._timed(op) for op in ("save", "load")}
        if not all(self.backend.torch.equal(d, s) for dsts, srcs in zip(self.dsts, self.srcs)
                   for d, s in zip(dsts, srcs)):
            raise RuntimeError("LMCache returned other bytes")
        for keys in self.keys:
            self.backend.remove(keys)
        return out
