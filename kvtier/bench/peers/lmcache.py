"""LMCache's CPU backend as a peer of `kvtier bench peers`, run in a venv of its own.

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

Where it runs: LMCache cannot be installed next to kvtier on a CPU machine (its dependencies are
CUDA packages), so ``tools/lmcache-env.sh`` builds a venv with LMCache 0.5.6 and only what its CPU
backend imports, and the bench runs this module there, as a subprocess (``python -m
kvtier.bench.peers.lmcache``, kvtier coming from the checkout through PYTHONPATH), speaking JSON
lines on stdin/stdout (no pickle). :func:`open_peer` finds the venv (:func:`find_env`: the
``--lmcache-env`` flag, else ``$KVTIER_LMCACHE_ENV``, else ``.lmcache-env`` in the checkout, else
this interpreter when it imports lmcache itself) and starts the subprocess; the figures then come
back as :class:`RunFigures`, timed inside the subprocess as before.

LMCache's API moves between releases (key fields, allocator arguments), so setting up is checked
by a round trip of one block; anything that fails (no venv, an import, that check) turns into a
note (``reason``), never a crash of the bench.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.peers.pool import RunFigures
from kvtier.bench.report import quantile

SLACK = 16 << 20  # arena bytes beyond what the bench holds: the probe block and 4 KiB rounding
CHUNK_TOKENS = 256  # LMCache's default chunk_size
ENV_VAR = "KVTIER_LMCACHE_ENV"
DEFAULT_ENV = ".lmcache-env"  # in the checkout, where tools/lmcache-env.sh builds it by default
BUILD = "bash tools/lmcache-env.sh"
# LMCache's usage telemetry is on by default (a POST to its vendor); only its cache engine sends it,
# which the bench never builds, but a benchmark must not phone home by accident.
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
DEFAULT_NAME = "LMCache LocalCPUBackend (in-process)"


# --- the bench's side: find the venv, run the peer there --------------------------------------


@dataclass(frozen=True, slots=True)
class LMCacheEnv:
    """The interpreter the LMCache peer runs in, and where it was found (for notes)."""

    python: str
    source: str


def find_env(flag: str | None = None) -> tuple[LMCacheEnv | None, str]:
    """The venv with LMCache (``flag``, else ``$KVTIER_LMCACHE_ENV``, else the checkout's
    ``.lmcache-env``, else this interpreter if it imports lmcache), or None and why not."""
    for given, source in ((flag, "--lmcache-env"), (os.environ.get(ENV_VAR), f"${ENV_VAR}")):
        if given:
            python = Path(given) / "bin" / "python"
            if python.exists():
                return LMCacheEnv(str(python), f"{source} {given}"), ""
            return None, f"{source} {given} has no bin/python (build it: {BUILD} {given})"
    import kvtier  # the checkout this kvtier runs from: the script builds the venv there

    default = Path(kvtier.__file__).resolve().parents[1] / DEFAULT_ENV
    if (default / "bin" / "python").exists():
        return LMCacheEnv(str(default / "bin" / "python"), str(default)), ""
    if importlib.util.find_spec("lmcache") is not None:
        return LMCacheEnv(sys.executable, "this interpreter"), ""
    return None, (f"no LMCache venv (build it, a few minutes: {BUILD}; or name one with --lmcache-env DIR "
                  f"or ${ENV_VAR})")


class LMCachePeer:
    """The LMCache peer: a subprocess of the venv's python holding one backend, or (``usable``
    False) the reason there is none. Every figure is timed inside the subprocess."""

    def __init__(self, proc: subprocess.Popen[str] | None, name: str, reason: str) -> None:
        self.proc = proc
        self.name = name
        self.reason = reason

    @property
    def usable(self) -> bool:
        return self.proc is not None

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None, \
            "a usable peer only"
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the LMCache subprocess exited with {self.proc.wait()} (its stderr is above)")
        answer: dict[str, Any] = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"the LMCache subprocess failed on {msg['cmd']}:\n{answer.get('error')}")
        return answer

    def runner(self, ns_id: bytes, clients: int, size: int, blocks: int,
               per_call: int) -> Callable[[], dict[str, RunFigures]]:
        """Build the blocks of one size there (untimed); the callable is one run: save then load
        from ``clients`` threads, then an untimed delete."""
        self._ask({"cmd": "prepare", "ns_id": ns_id.hex(), "clients": clients, "size": size,
                   "blocks": blocks, "per_call": per_call})

        def once() -> dict[str, RunFigures]:
            figures = self._ask({"cmd": "run"})["figures"]
            return {op: RunFigures(**fig) for op, fig in figures.items()}
        return once

    def held(self) -> tuple[int, int]:
        """Blocks in the backend's hot cache, and bytes allocated from its arena, now."""
        answer = self._ask({"cmd": "held"})
        return int(answer["blocks"]), int(answer["allocated"])

    def close(self) -> None:
        """Stop the subprocess (its backend and arena go with it). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                proc.stdin.close()
        except OSError:
            pass  # it already died: its pipe is gone
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def open_peer(capacity: int, env_dir: str | None = None) -> LMCachePeer:
    """Start the LMCache peer in its venv with an arena for ``capacity`` bytes of blocks, or say
    (in ``reason``, one line) why there is none here."""
    env, why = find_env(env_dir)
    if env is None:
        return LMCachePeer(None, DEFAULT_NAME, why)
    from kvtier.bench.daemon import child_env  # the checkout's kvtier on the child's PYTHONPATH

    proc_env = {**child_env(), **QUIET}
    # LMCache logs at INFO to stderr from import on; the bench's own progress lines are what a
    # reader wants there. Its warnings (memory pressure) still show; LMCACHE_LOG_LEVEL overrides.
    proc_env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    proc = subprocess.Popen([env.python, "-m", "kvtier.bench.peers.lmcache"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1, env=proc_env)
    peer = LMCachePeer(proc, DEFAULT_NAME, "")
    try:
        answer = peer._ask({"cmd": "open", "capacity": capacity})
    except RuntimeError as exc:
        peer.close()
        return LMCachePeer(None, DEFAULT_NAME, f"{exc} ({env.source})".replace("\n", " "))
    if answer["reason"]:
        peer.close()
        return LMCachePeer(None, DEFAULT_NAME, f"{answer['reason']} ({env.source})")
    peer.name = answer["name"]
    return peer


# --- the subprocess's side: the backend, in LMCache's venv -------------------------------------


@dataclass(slots=True)
class LMCacheProbe:
    """The backend (None when unusable here), why not, and the name the rows give it."""

    backend: Any
    reason: str
    name: str = DEFAULT_NAME

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
    """Set up a CPU backend in this process able to hold ``capacity`` bytes of blocks, or say why
    it cannot be here (the subprocess's side of :func:`open_peer`)."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # see open_peer
    for k, v in QUIET.items():
        os.environ.setdefault(k, v)
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

    def allocated(self) -> int:
        """Bytes allocated from the arena now (0 once every block went back)."""
        return int(self.allocator.pin_allocator.total_allocated_size)

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


def _serve() -> int:
    """The subprocess's loop: one JSON command per line on stdin, one answer per line on stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever LMCache prints goes to stderr, never into the answers
    probe: LMCacheProbe | None = None
    once: Callable[[], dict[str, RunFigures]] | None = None
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            cmd = msg["cmd"]
            try:
                if cmd == "open":
                    assert probe is None, "one backend per subprocess"
                    probe = open_backend(int(msg["capacity"]))
                    reply: dict[str, Any] = {"ok": True, "name": probe.name, "reason": probe.reason}
                elif cmd == "prepare":
                    assert probe is not None and probe.backend is not None, "open comes first, and worked"
                    once = None  # free the previous size's tensors first
                    once = probe.runner(bytes.fromhex(msg["ns_id"]), int(msg["clients"]), int(msg["size"]),
                                        int(msg["blocks"]), int(msg["per_call"]))
                    reply = {"ok": True}
                elif cmd == "run":
                    assert once is not None, "prepare comes before run"
                    reply = {"ok": True, "figures": {op: asdict(f) for op, f in once().items()}}
                elif cmd == "held":
                    assert probe is not None and probe.backend is not None, "open comes first, and worked"
                    reply = {"ok": True, "blocks": probe.backend.held(), "allocated": probe.backend.allocated()}
                elif cmd == "stop":
                    break
                else:
                    reply = {"ok": False, "error": f"unknown command {cmd!r}"}
            except Exception:
                reply = {"ok": False, "error": traceback.format_exc()}
            out.write(json.dumps(reply) + "\n")
    finally:
        if probe is not None:
            probe.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.peers.lmcache``: the peer's subprocess; ``--check``: one block
    through a small backend here, said in one line (tools/lmcache-env.sh ends with it)."""
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.peers.lmcache", description=main.__doc__)
    parser.add_argument("--check", action="store_true", help="set up a small backend, round-trip one block, say so")
    if not parser.parse_args(argv).check:
        return _serve()
    probe = open_backend(SLACK)
    try:
        if probe.backend is None:
            print(f"LMCache check failed: {probe.reason}", file=sys.stderr)
            return 1
        print(f"{probe.name}: a block went in and came back the same")
        return 0
    finally:
        probe.close()


if __name__ == "__main__":
    sys.exit(main())
