"""`kvtier bench gpu`: host↔device copies through the connector and the GPU tier vs raw copies.

CUDA only: without a CUDA device the suite prints why and returns no rows (``--device cpu``
runs the same code on host memory, which checks the code path, not a GPU).

Rows (GB/s of KV bytes, higher is better; every timed region ends with a device synchronise):
  * ``connector load``: :meth:`KVConnectorCore.load` of ``--blocks`` blocks into the engine's
    paged caches on the device (vLLM flash layout, bfloat16), from a real ``kvtier serve``
    subprocess over the unix socket: the records come out of the daemon's shared memory, are
    checked, and are scattered into the pages; next to one copy of the same bytes from pinned
    host memory to the device (``cudaMemcpy`` through torch ``copy_``).
  * ``connector save``: :meth:`KVConnectorCore.save` of those pages (gather on the device, one
    device→host copy per batch, encode, save); next to a device→pinned-host copy of the bytes.
    The blocks are deleted (untimed) after each repetition, so every save stores them again.
  * ``connector layer-wise save`` / ``layer-wise load``: the same bytes through
    :meth:`KVConnectorCore.start_save` (each layer copied to pinned staging on the save stream)
    and :meth:`KVConnectorCore.start_load` (records verified, then each layer copied from pinned
    staging on the load stream, the compute stream waiting per layer), next to the same raw copies.
  * ``GPU tier copy_in`` / ``copy_out`` with pinned host memory: :class:`kvtier.daemon.store.gpu.GpuTier`
    slots filled from and drained to pinned host blocks, next to the raw pinned copies.
  * ``GPU tier device-to-device``: ``copy_in`` of device tensors into GPU-tier slots, next to a
    device ``copy_`` of the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.bench.daemon import BenchDaemon
from kvtier.bench.report import Row, SuiteResult, Timer, alternate, gbps, progress, throughput_row
from kvtier.client import Client
from kvtier.connector.core import KVConnectorCore
from kvtier.connector.pages import get_page_layout
from kvtier.daemon.store.gpu import GpuTier
from kvtier.daemon.store.types import Slot
from kvtier_protocol.namespace import Namespace

DESCRIPTION = "pinned host<->device copies through the connector vs raw cudaMemcpy (CUDA only)"
MIB = 1 << 20
PAGE_LAYOUT = "vllm-flash"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="torch device (default cuda; cpu checks the code path)")
    parser.add_argument("--blocks", type=int, default=None, help="blocks per copy (default 64; --quick 8)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the KV geometry (default 32: 2 MiB blocks of 16 tokens, Llama-3-8B; --quick 4)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--work-dir", default=None, help="parent of the daemon's temp dir (default $TMPDIR)")


def cuda_missing(device: str) -> str | None:
    """Why ``device`` cannot run this suite, or None when it can."""
    if torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"CUDA is not available (torch {torch.__version__}); the gpu suite has nothing to measure"
    return None


def run(args: argparse.Namespace) -> SuiteResult:
    result = SuiteResult("gpu")
    why = cuda_missing(args.device)
    if why is not None:
        progress(f"gpu: skipped: {why}")
        return result
    reps = args.repetitions or (2 if args.quick else 5)
    blocks = args.blocks or (8 if args.quick else 64)
    ns = Namespace(model="bench/gpu", revision="0", attention="mha", num_layers=args.layers or (4 if args.quick else 32),
                   num_kv_heads=8, head_dim=128, kv_dtype="bfloat16", block_tokens=args.block_tokens,
                   hash_tokens=args.block_tokens)
    device = torch.device(args.device)
    nbytes = ns.block_payload_bytes()
    progress(f"gpu: {blocks} blocks of {nbytes / MIB:g} MiB on {device}, {reps} repetitions")
    result.rows += _tier_rows(device, nbytes, blocks, reps)
    result.rows += _connector_rows(ns, device, blocks, reps, args.work_dir)
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host bytes, pinned when the device is a GPU (what a DMA copy needs to run at full speed)."""
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    return t.pin_memory() if device.type == "cuda" else t


def _timed(fn: Callable[[], None], nbytes: int, device: torch.device) -> Callable[[], float]:
    def once() -> float:
        _sync(device)
        with Timer() as t:
            fn()
            _sync(device)
        return gbps(nbytes, t.seconds)
    return once


# --- the GPU tier ------------------------------------------------------------------------------


def _tier_rows(device: torch.device, nbytes: int, blocks: int, reps: int) -> list[Row]:
    tier = GpuTier(blocks * nbytes + 64 * MIB, device=device, segment_bytes=max(nbytes, 256 * MIB))
    try:
        slots = [tier.allocate(nbytes) for _ in range(blocks)]
        if any(s is None for s in slots):
            raise RuntimeError("gpu: the GPU tier could not hold the bench's blocks")
        placed: list[Slot] = [s for s in slots if s is not None]
        host = [_host(nbytes, device) for _ in range(blocks)]
        back = [_host(nbytes, device) for _ in range(blocks)]
        dev_src = [h.to(device) for h in host]
        dev_dst = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(blocks)]
        total = blocks * nbytes

        def tier_in(srcs: list[torch.Tensor]) -> Callable[[], None]:
            def go() -> None:
                for s, src in zip(placed, srcs):
                    tier.copy_in(s, src)
            return go

        def tier_out() -> None:
            for s, dst in zip(placed, back):
                tier.copy_out(s, dst)

        def raw(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Callable[[], None]:
            def go() -> None:
                for d, s in zip(dsts, srcs):
                    d.copy_(s, non_blocking=True)
            return go

        label = f"{blocks} x {nbytes / MIB:g} MiB"
        rows = []
        for case, kv, base_name, base in (
            (f"GPU tier copy_in from pinned host, {label}", tier_in(host), "torch copy_ pinned→device", raw(dev_dst, host)),
            (f"GPU tier copy_out to pinned host, {label}", tier_out, "torch copy_ device→pinned", raw(back, dev_src)),
            (f"GPU tier device-to-device, {label}", tier_in(dev_src), "torch copy_ device→device", raw(dev_dst, dev_src)),
        ):
            progress(f"gpu: {case}")
            k, b = alternate(_timed(kv, total, device), _timed(base, total, device), repetitions=reps)
            rows.append(throughput_row(case, "throughput", "GB/s", k, base_name, b))
        tier_out()
        _sync(device)
        if not all(torch.equal(a, b) for a, b in zip(back, host)):
            raise RuntimeError("gpu: the GPU tier gave back other bytes than it was given")
        return rows
    finally:
        tier.close()


# --- the connector through a real daemon -------------------------------------------------------


def _connector_rows(ns: Namespace, device: torch.device, blocks: int, reps: int, work_dir: str | None) -> list[Row]:
    nbytes = ns.block_payload_bytes()
    layout = get_page_layout(PAGE_LAYOUT)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(layout.cache_shape(ns, blocks), generator=gen).to(torch.bfloat16).to(device)
              for _ in range(ns.num_layers)]
    hashes = [hashlib.sha256(b"bench gpu" + i.to_bytes(8, "little")).digest() for i in range(blocks)]
    pages = list(range(blocks))
    total = blocks * nbytes
    host = _host(total, device)
    back = _host(total, device)
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-gpu-", dir=work_dir))
    daemon = BenchDaemon(work, ["--rest", "off", "--host-bytes", str(2 * total + 64 * MIB),
                                "--disk-bytes", str(64 * MIB)], suite="gpu")
    with daemon.running():
        with Client.connect(daemon.address, timeout_s=60.0) as client:
            core = KVConnectorCore(ns, client=client, page_layout=PAGE_LAYOUT, timeout_s=60.0)
            try:
                core.bind_kv_caches(caches)
                return _connector_measure(core, client, ns, hashes, pages, caches, host, back, dev, reps)
            finally:
                core.close()


def _connector_measure(core: KVConnectorCore, client: Client, ns: Namespace, hashes: list[bytes], pages: list[int],
                       caches: list[torch.Tensor], host: torch.Tensor, back: torch.Tensor, dev: torch.Tensor,
                       reps: int) -> list[Row]:
    device = caches[0].device
    total = host.numel()
    label = f"{len(hashes)} x {ns.block_payload_bytes() / MIB:g} MiB"

    def save() -> None:
        stored = core.save(hashes, pages)
        if stored != len(hashes):
            raise RuntimeError(f"gpu: the connector stored {stored} of {len(hashes)} blocks")

    def save_once() -> float:
        client.delete(ns.ns_id, hashes)  # untimed: the next save stores every block again
        return _timed(save, total, device)()

    def load() -> None:
        loaded = core.load(hashes, pages)
        if loaded != len(hashes):
            raise RuntimeError(f"gpu: the connector loaded {loaded} of {len(hashes)} blocks")

    def layer_save() -> None:
        save = core.start_save(hashes, pages)
        for i in range(len(caches)):
            save.layer_done(i)
        core.release_pages()
        assert save.job is not None, "every layer was fed"
        stored = core.wait(save.job).num_blocks
        if stored != len(hashes):
            raise RuntimeError(f"gpu: the connector stored {stored} of {len(hashes)} blocks layer by layer")

    def layer_save_once() -> float:
        client.delete(ns.ns_id, hashes)
        return _timed(layer_save, total, device)()

    def layer_load() -> None:
        load = core.start_load(hashes, pages)
        for i in range(len(caches)):
            load.wait_layer(i, core.streams.compute)
        loaded = load.result().num_blocks
        if loaded != len(hashes):
            raise RuntimeError(f"gpu: the connector loaded {loaded} of {len(hashes)} blocks layer by layer")

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)

    def d2h() -> None:
        back.copy_(dev, non_blocking=True)

    progress(f"gpu: connector save, {label}")
    kv_save, base_save = alternate(save_once, _timed(d2h, total, device), repetitions=reps)
    expected = [c.clone() for c in caches]
    progress(f"gpu: connector load, {label}")
    kv_load, base_load = alternate(_timed(load, total, device), _timed(h2d, total, device), repetitions=reps)
    for c in caches:
        c.zero_()
    load()
    if not all(torch.equal(a, b) for a, b in zip(caches, expected)):
        raise RuntimeError("gpu: the connector loaded other KV than it saved")
    progress(f"gpu: connector layer-wise save, {label}")
    kv_lsave, base_lsave = alternate(layer_save_once, _timed(d2h, total, device), repetitions=reps)
    progress(f"gpu: connector layer-wise load, {label}")
    kv_lload, base_lload = alternate(_timed(layer_load, total, device), _timed(h2d, total, device), repetitions=reps)
    for c in caches:
        c.zero_()
    layer_load()
    _sync(device)
    if not all(torch.equal(a, b) for a, b in zip(caches, expected)):
        raise RuntimeError("gpu: the connector loaded other KV layer by layer than it saved")
    return [
        throughput_row(f"connector save (device→daemon), {label}", "throughput", "GB/s", kv_save,
                       "torch copy_ device→pinned", base_save),
        throughput_row(f"connector load (daemon→device), {label}", "throughput", "GB/s", kv_load,
                       "torch copy_ pinned→device", base_load),
        throughput_row(f"connector layer-wise save (device→daemon), {label}", "throughput", "GB/s", kv_lsave,
                       "torch copy_ device→pinned", base_lsave),
        throughput_row(f"connector layer-wise load (daemon→device), {label}", "throughput", "GB/s", kv_lload,
                       "torch copy_ pinned→device", base_lload),
    ]


__all__ = ["DESCRIPTION", "add_arguments", "cuda_missing", "run"]
