"""LMCache's CPU backend as a peer of `kvtier bench peers`, when LMCache is importable here.

LMCache keeps its CPU tier inside the engine process (``LocalCPUBackend``, the L1 of its
StorageManager): no socket and no second process, so its figures are the cost of an in-process
library, the floor any daemon's IPC sits above. The bench drives one backend from ``clients``
threads (they share it as an engine's threads would; the copies are torch ``copy_``, which
releases the GIL). Blocks go in as ``MemoryObj``\\ s of the backend's own allocator (a plain CPU
tensor, since no pinned memory is needed without a GPU): allocate -> copy the payload in ->
``submit_put_task``; ``get_blocking`` -> copy out -> drop the reference.

LMCache's API moves between releases (key fields, allocator arguments), so setting up is checked
by a round trip of one block; anything that fails turns into a note (``reason``), never a crash.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.bench.peers_pool import RunFigures
from kvtier.bench.report import quantile


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


def open_backend(capacity: int) -> LMCacheProbe:
    """Set up a CPU backend holding ``capacity`` bytes, or say why it cannot be here."""
    try:
        import lmcache
    except ImportError as exc:
        return LMCacheProbe(None, f"LMCache is not importable here ({exc})")
    version = getattr(lmcache, "__version__", "?")
    try:
        backend = _Backend(capacity)
        backend.round_trip()
    except Exception as exc:  # any API drift between LMCache releases: a note, not a crash
        return LMCacheProbe(None, f"LMCache {version} is importable but its CPU backend could not be "
                                  f"set up here: {type(exc).__name__}: {exc}")
    return LMCacheProbe(backend, "", f"LMCache {version} LocalCPUBackend (in-process)")


class _Backend:
    """The few calls of LMCache's LocalCPUBackend the workload needs."""

    def __init__(self, capacity: int) -> None:
        import dataclasses

        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat, TensorMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.torch = torch
        config = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True,
                                                   max_local_cpu_size=capacity / 2**30)
        allocator = TensorMemoryAllocator(torch.empty(capacity, dtype=torch.uint8))
        self.backend = LocalCPUBackend(config, memory_allocator=allocator)
        self.fmt = next((getattr(MemoryFormat, n) for n in ("BINARY_BUFFER", "BINARY") if hasattr(MemoryFormat, n)),
                        next(iter(MemoryFormat)))
        # Key fields differ between releases: fill the ones this release's dataclass has.
        names = {f.name for f in dataclasses.fields(CacheEngineKey)}
        self.key_fields = {k: v for k, v in (("fmt", "vllm"), ("model_name", "kvtier-bench"), ("world_size", 1),
                                              ("worker_id", 0), ("dtype", torch.uint8)) if k in names}
        self.key_cls = CacheEngineKey

    def key(self, chunk_hash: bytes) -> Any:
        return self.key_cls(**self.key_fields, chunk_hash=int.from_bytes(chunk_hash[:8], "little"))

    def put(self, key: Any, payload: Any) -> None:
        obj = self.backend.allocate(self.torch.Size([payload.numel()]), self.torch.uint8, fmt=self.fmt)
        if obj is None:
            raise RuntimeError("LMCache CPU backend full")
        obj.tensor.view(-1)[:payload.numel()].copy_(payload)
        self.backend.submit_put_task(key, obj)
        obj.ref_count_down()  # the backend holds its own reference now (as StorageManager does)

    def get_into(self, key: Any, dst: Any) -> None:
        obj = self.backend.get_blocking(key)
        if obj is None:
            raise RuntimeError("LMCache CPU backend lost a block")
        dst.copy_(obj.tensor.view(-1)[:dst.numel()])
        obj.ref_count_down()

    def remove(self, key: Any) -> None:
        self.backend.remove(key)

    def round_trip(self) -> None:
        src = self.torch.arange(4096, dtype=self.torch.int64).to(self.torch.uint8)
        dst = self.torch.zeros_like(src)
        key = self.key(hashlib.sha256(b"kvtier bench peers lmcache probe").digest())
        self.put(key, src)
        self.get_into(key, dst)
        self.remove(key)
        if not self.torch.equal(src, dst):
            raise RuntimeError("a block came back different")


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
        lock = threading.Lock()
        start = threading.Barrier(self.clients)

        def client(c: int) -> None:
            keys, srcs, dsts = self.keys[c], self.srcs[c], self.dsts[c]
            mine: list[float] = []
            start.wait()
            t0 = time.monotonic()
            for lo in range(0, len(keys), self.per_call):
                s = time.monotonic()
                for i in range(lo, min(len(keys), lo + self.per_call)):
                    if op == "save":
                        self.backend.put(keys[i], srcs[i])
                    else:
                        self.backend.get_into(keys[i], dsts[i])
                mine.append((time.monotonic() - s) * 1e3)
            t1 = time.monotonic()
            with lock:
                spans.append((t0, t1))
                lat.extend(mine)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(spans) != self.clients:
            raise RuntimeError("an LMCache client thread failed")
        window = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
        total = self.clients * len(self.keys[0]) * self.size
        return RunFigures(total / window / 1e9, quantile(lat, 0.5), quantile(lat, 0.99), len(lat))

    def once(self) -> dict[str, RunFigures]:
        out = {op: self._timed(op) for op in ("save", "load")}
        if not all(self.backend.torch.equal(d, s) for d, s in zip(self.dsts[0], self.srcs[0])):
            raise RuntimeError("LMCache returned other bytes")
        for keys in self.keys:
            for k in keys:
                self.backend.remove(k)
        return out
