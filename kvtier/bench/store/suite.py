"""`kvtier bench store`: the tiered store's host and disk paths next to memcpy and the raw disk.

Rows:
  * ``host put`` / ``host get`` per block size (GB/s): ``reserve → copy into the slot → commit``
    and ``acquire → copy out of the slot → release`` through :class:`TieredStore`, next to a torch
    ``copy_`` of the same bytes (memcpy: as fast as glibc's here, on torch's threads). The copies
    are kvtier's client's (``kvtier.client.memcopy.copy_many_threads`` of each batch, on ``--copy-threads``,
    default the client's), so the ratio is what a client of the store gets next to memcpy.
    ``host ..., vs its own copy``: the same puts and gets next to that copy alone, batch by batch
    on the same threads: what the store's bookkeeping costs. Source and destination buffers
    rotate over a working set of ``--working-set-mib`` on both sides, so neither side measures
    the cache. Headers (and so the client's payload checksum) are computed before the timed
    region.
  * ``disk write``, ``disk read``, ``disk→host promote``: the disk tier next to dd with O_DIRECT
    (:mod:`kvtier.bench.store.disk`).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from pathlib import Path

import torch

from kvtier.client import memcopy
from kvtier.bench.report import Row, SuiteResult, Timer, alternate, gbps, progress, threads_label, throughput_row
from kvtier.bench.store.blocks import MIB, NS, batches, block_header, chain_hash, get_blocks, put_blocks, random_blocks
from kvtier.bench.store.disk import disk_rows
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.store import TieredStore

DESCRIPTION = "tiered store: host put/get vs torch copy_, disk write/read/promote vs dd O_DIRECT"
__all__ = ["DESCRIPTION", "NS", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mib", default="2,8,32", help="host block sizes in MiB (default 2,8,32)")
    parser.add_argument("--working-set-mib", type=int, default=None, help="host rotation per side (default 256; --quick 64)")
    parser.add_argument("--disk-mib", type=int, default=None, help="disk data set (default 512; --quick 32)")
    parser.add_argument("--disk-block-mib", type=int, default=8, help="disk block size in MiB (default 8, as dd bs=8M)")
    parser.add_argument("--batch-mib", type=int, default=64, help="bytes of blocks per reserve/acquire/put_many call")
    parser.add_argument("--data-dir", default=None, help="directory on the disk to test (default: a temp dir in /var/tmp)")
    parser.add_argument("--copy-threads", type=int, default=None,
                        help="threads of kvtier's copies (default: the client's, the CPUs of this process, at most 4)")
    parser.add_argument("--cold", choices=("fadvise", "drop_caches"), default="fadvise",
                        help="how disk reads are kept out of the page cache (default fadvise)")


def run(args: argparse.Namespace) -> SuiteResult:
    reps = args.repetitions or (2 if args.quick else 5)
    ws = (args.working_set_mib or (64 if args.quick else 256)) * MIB
    batch = args.batch_mib * MIB
    result = SuiteResult("store")
    threads = args.copy_threads or memcopy.default_copy_threads()
    base = Path(args.data_dir) if args.data_dir else Path("/var/tmp")
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=base))
    loop = asyncio.new_event_loop()
    try:
        for mib in (int(x) for x in args.sizes_mib.split(",") if x.strip()):
            result.rows += _host_rows(loop, mib * MIB, ws, batch, reps, threads)
        block = args.disk_block_mib * MIB
        count = max(1, (args.disk_mib or (32 if args.quick else 512)) * MIB // block)
        result.rows += disk_rows(loop, work, block, count, batch, reps, args.cold)
    finally:
        loop.close()
        shutil.rmtree(work, ignore_errors=True)
    return result


# --- host --------------------------------------------------------------------------------------


def _host_rows(loop: asyncio.AbstractEventLoop, nbytes: int, ws: int, batch: int, reps: int,
               threads: int) -> list[Row]:
    n = max(2, ws // nbytes)
    mib = nbytes // MIB
    progress(f"store: host {mib} MiB blocks, {n} in rotation ({n * nbytes // MIB} MiB per side), "
             f"copies on {threads_label(threads)}")
    srcs = random_blocks(n, nbytes, seed=mib)
    dsts = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]
    src_views = [s.numpy() for s in srcs]
    dst_views = [d.numpy() for d in dsts]
    hashes = [chain_hash(i) for i in range(n)]
    headers = [block_header(i, memoryview(s)) for i, s in enumerate(src_views)]
    per = max(1, batch // nbytes)
    # No background scrub here: this measures the host tier's own path (the daemon's scrub runs in the
    # daemon process, off the client's path; `kvtier bench dataplane` measures it for real).
    cfg = StoreConfig(host_bytes=n * nbytes + 64 * MIB, host_name_prefix="kvtier-bench", scrub_commits=False)
    store = TieredStore(cfg)
    loop.run_until_complete(store.start())
    try:
        assert store.host is not None
        store.host.prefault_done.wait()

        def memcpy() -> float:
            with Timer() as t:
                for s, d in zip(srcs, dsts):
                    d.copy_(s)
            return gbps(n * nbytes, t.seconds)

        def own_copy() -> float:  # the put's and get's copy alone, batch by batch
            with Timer() as t:
                for r in batches(n, per):
                    memcopy.copy_many_threads(dst_views[r.start:r.stop], src_views[r.start:r.stop], threads)
            return gbps(n * nbytes, t.seconds)

        def put() -> float:
            with Timer() as t:
                loop.run_until_complete(put_blocks(store, hashes, headers, src_views, per, threads))
            loop.run_until_complete(store.delete(NS, hashes))  # untimed: the next round starts empty
            return gbps(n * nbytes, t.seconds)

        def get() -> float:
            with Timer() as t:
                got = loop.run_until_complete(get_blocks(store, hashes, dst_views, per, threads))
            assert got == n, f"bench get found {got} of {n} blocks"
            return gbps(n * nbytes, t.seconds)

        own = f"its own copy (kvtier.client.memcopy, {threads_label(threads)})"
        rows = []
        for name, fn in (("put", put), ("get", get)):
            if name == "get":
                loop.run_until_complete(put_blocks(store, hashes, headers, src_views, per, threads))
            kv, base = alternate(fn, memcpy, repetitions=reps)
            rows.append(throughput_row(f"host {name} {mib}MiB", "throughput", "GB/s", kv, "torch copy_", base))
            kv, base = alternate(fn, own_copy, repetitions=reps)
            rows.append(throughput_row(f"host {name} {mib}MiB, vs its own copy", "throughput", "GB/s", kv, own, base))
        assert all(torch.equal(s, d) for s, d in zip(srcs, dsts)), "bench get returned other bytes"
        return rows
    finally:
        loop.run_until_complete(store.close())
