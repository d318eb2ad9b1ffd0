"""`kvtier bench dataplane`: the real daemon, driven by the real client, next to memcpy and a ping.

The suite starts ``kvtier serve`` as a subprocess on a temporary directory (unix socket plus TCP
on 127.0.0.1, REST off) and connects one :class:`kvtier.client.Client` to each endpoint.

Rows:
  * ``shm put`` / ``tcp put`` per block size (GB/s of payload): ``Client.save`` of batches of
    ``--batch-mib`` bytes of blocks, through the unix socket (copy into the daemon's shared
    memory, into slots it granted ahead of the save → ``place``, SPEC §7.4; the first save of a
    block size, and every save with ``--grant-mib 0``: reserve → copy → commit, pipelined in
    sub-batches with ``--pipeline-mib``) and through TCP (records inline in ``put`` frames). The
    blocks are deleted (untimed) after each repetition, so every save stores new blocks, never
    "exists".
  * ``shm put ..., write-behind``: the same saves from a client with
    ``ClientOptions.write_behind`` (each save returns once its payloads are in shared memory; the
    commits are answered while the next save copies), timed up to ``Client.flush()`` returning,
    i.e. until the daemon confirmed every commit of the repetition.
  * ``shm get`` / ``tcp get`` (GB/s of payload): ``Client.load_into`` of the same batches into
    preallocated destination tensors (acquire → copy out of shared memory → release, pipelined
    with ``--pipeline-mib``; ``get`` with records inline → copy and verify), the destinations
    rotating over the working set exactly as the baseline's do. The gets start once the daemon has checked the stored blocks (it does
    so within ``kvtier.daemon.store.scrub.MAX_DELAY_S`` of a save), as a later load of a saved prefix
    finds them: the copy out of shared memory is then not hashed again by the client.
  * Two baselines for each of the four, timed in turn with it (every repetition runs all three):
    - ``kvtier.client.memcopy.copy_many_threads`` of the same bytes, batch by batch on as many threads
      as the client copies with (``--copy-threads``; the client's default: the CPUs of this
      process, at most 4): the very copy the client makes into and out of shared memory
      (non-temporal stores where the C routine is built; a plain memcpy otherwise), so the
      ratio is what kvtier adds to its own copy. The stricter of the two.
    - ``memcpy (glibc, N threads)``: the same function, threads and runs with glibc's ``memcpy``
      as the copy of each run (``streaming=False``): the bytes moved the ordinary way, the
      memcpy of the data plane's speed target (shared-memory put and get ≥ 0.85× memcpy).
    Sources and destinations of every side rotate over ``--working-set-mib`` (default 256) so none
    measures the CPU cache. Records (header + payload, built with kvtier_protocol.header on
    random bytes) are built once, before anything is timed.
  * ``..., daemon CPU`` (µs per block, Linux): the CPU time the daemon's threads ran during each
    of those timed repetitions (``/proc/PID/task/*/schedstat``), per block, beside the time the
    client's copy of one block takes (the strict baseline's): the share of a core the daemon needs
    while a client streams blocks. On a host with fewer free cores than copy threads plus one,
    that time is taken from the copy.
  * ``... 64 x 64KiB`` (``--small-batch``): the same put and get rows (shm, write-behind, TCP,
    the daemon's CPU per block, the memcpy baselines) for batches of 64 blocks of 64 KiB per call,
    a 4 MiB call whose cost is almost all per block and per request rather than per byte: the
    per-request floor (a 16-token block of a small model, or of one tensor-parallel rank, is
    about this size). The blocks rotate over the same working set, in whole batches.
  * ``memcpy ...``: that copy next to a torch ``copy_`` of the same bytes on the same threads
    (torch's copy is as fast as glibc's memcpy here): how much faster the client's copy is than
    the usual one.
  * ``lookup`` p50 / p99 (ms): ``Client.lookup`` of the chain hashes of a 128K-token prompt
    (512 keys of 256 tokens, all stored, so the daemon walks every one), next to a ``ping`` over
    the same socket: the round trip every call pays, the floor a lookup sits on.
  * ``start to ready`` (s): ``kvtier serve`` with a host tier of min(4 GiB, half of /dev/shm's free
    space), from the process's start to its ready line, next to a Python that only imports the
    daemon's modules (``python -c "import kvtier.daemon.server.daemon"``): start-up must not wait
    for the host tier's memory (it is pre-faulted in the background), so the two stay close.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from kvtier.client import memcopy
from kvtier.bench.daemon import BenchDaemon, child_env
from kvtier.bench.report import (Row, Samples, SuiteResult, Timer, alternate, alternate_many, gbps,
                                 latency_row, ping_latency_rows, progress, threads_label, throughput_row)
from kvtier.client import Client
from kvtier.daemon.store.scrub import MAX_DELAY_S
from kvtier_protocol.header import BlockHeader, Section, decode_header, encode_header, payload_checksum
from kvtier_protocol.keys import chain_hashes

DESCRIPTION = "daemon data plane: put/get over shared memory and TCP vs memcpy; lookup p50/p99 vs ping"
MIB = 1 << 20
NS = hashlib.sha256(b"kvtier bench dataplane").digest()[:16]
LOOKUP_HASH_TOKENS = 256
LOOKUP_PAYLOAD = 4096  # small blocks: the lookup rows measure the index walk, not memory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mib", default=None,
                        help="block sizes in MiB (default 2,8,32; --quick 2,8)")
    parser.add_argument("--working-set-mib", type=float, default=None,
                        help="bytes rotated per side and size (default 256; --quick 64)")
    parser.add_argument("--batch-mib", type=float, default=64,
                        help="bytes of blocks per save/load call (default 64)")
    parser.add_argument("--lookup-keys", type=int, default=512,
                        help="chain hashes of 256 tokens per lookup (default 512: a 128K-token prompt)")
    parser.add_argument("--lookup-calls", type=int, default=None,
                        help="lookups (and pings) per repetition (default 1000; --quick 200)")
    parser.add_argument("--copy-threads", type=int, default=None,
                        help="threads the shm clients copy with, and the baseline copy and the torch "
                             "copy_ reference too (default: the client's, the CPUs of this process, at "
                             "most 4)")
    parser.add_argument("--work-dir", default=None,
                        help="parent of the daemon's temp dir (socket, token, disk, log; default $TMPDIR)")
    parser.add_argument("--pipeline-mib", type=float, default=None,
                        help="payload MiB per pipelined sub-batch of the shm rows (default: the "
                             "client's, 0: one request batch at a time, each answer awaited)")
    parser.add_argument("--grant-mib", type=float, default=None,
                        help="MiB of slots each shm client keeps granted ahead of its saves "
                             "(default: the client's; 0: every save reserves and commits, the "
                             "protocol before granted slots)")
    parser.add_argument("--small-batch", default="64x64", metavar="BLOCKSxKIB",
                        help="the per-request floor rows: calls of BLOCKS blocks of KIB KiB each "
                             "(default 64x64; 'off': none)")
    parser.add_argument("--daemon-profile", metavar="FILE", default=None,
                        help="run the daemon under cProfile and write its stats to FILE")


def _small_batch(text: str) -> tuple[int, int] | None:
    """``"64x64"`` -> (64 blocks per call, 65536 bytes each); ``"off"`` -> None."""
    if text.strip().lower() in ("off", "0", ""):
        return None
    count, _, kib = text.lower().partition("x")
    try:
        blocks, nbytes = int(count), int(float(kib) * 1024)
    except ValueError:
        blocks = nbytes = 0
    if blocks < 1 or nbytes < 64 or nbytes % 64:
        raise ValueError(f"--small-batch {text!r}: BLOCKSxKIB, at least one block of a multiple of 64 bytes")
    return blocks, nbytes


def run(args: argparse.Namespace) -> SuiteResult:
    reps = args.repetitions or (2 if args.quick else 5)
    sizes_text = args.sizes_mib or ("2,8" if args.quick else "2,8,32")
    sizes = [int(float(x) * MIB) for x in sizes_text.split(",") if x.strip()]
    ws = int((args.working_set_mib or (64 if args.quick else 256)) * MIB)
    small = _small_batch(args.small_batch)
    # the small rows' working set: whole calls of the small batch, at least one
    small_ws = 0 if small is None else max(1, ws // (small[0] * small[1])) * small[0] * small[1]
    batch = int(args.batch_mib * MIB)
    calls = args.lookup_calls or (200 if args.quick else 1000)
    result = SuiteResult("dataplane")
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-dp-", dir=args.work_dir))
    # Twice the working set (slack for the allocator's slabs as block sizes change) plus the lookup
    # blocks: nothing is ever evicted, so no row touches the disk tier.
    host_bytes = 2 * max(ws, small_ws) + max(sizes) + args.lookup_keys * (LOOKUP_PAYLOAD + 4096) + 64 * MIB
    daemon = _daemon(work, host_bytes, args.daemon_profile)
    with daemon.running():
        threads = args.copy_threads or memcopy.default_copy_threads()
        pipe: dict[str, int] = {"copy_threads": threads}
        if args.pipeline_mib is not None:
            pipe["pipeline_bytes"] = int(args.pipeline_mib * MIB)
        if args.grant_mib is not None:
            pipe["grant_bytes"] = int(args.grant_mib * MIB)
        with Client.connect(f"unix:{daemon.socket}", timeout_s=60.0, **pipe) as shm, \
                Client.connect(f"unix:{daemon.socket}", timeout_s=60.0, write_behind=True, **pipe) as behind, \
                Client.connect(daemon.tcp, token=daemon.token(), timeout_s=60.0) as tcp:
            assert shm.session is not None and shm.session.shm is not None, "unix socket without segments"
            for nbytes in sizes:
                result.rows += _block_rows(shm, behind, tcp, nbytes, ws, batch, reps, threads, daemon.cpu_seconds)
            if small is not None:
                count, nbytes = small
                result.rows += _block_rows(shm, behind, tcp, nbytes, small_ws, count * nbytes, reps, threads,
                                           daemon.cpu_seconds, label=f"{count} x {nbytes / 1024:g}KiB")
            result.rows += _lookup_rows(shm, tcp, args.lookup_keys, calls, reps)
    result.rows.append(_startup_row(args.work_dir, reps))
    return result


def _startup_row(work_dir: str | None, reps: int) -> Row:
    """Seconds from ``kvtier serve``'s start to its ready line with a large host tier, beside an
    interpreter that imports the daemon's modules and exits (the floor of any start)."""
    shm = os.statvfs("/dev/shm")
    host_bytes = min(4 << 30, shm.f_bavail * shm.f_frsize // 2) >> 20 << 20
    progress(f"dataplane: start to ready with a {host_bytes / MIB:g} MiB host tier")
    imports = [sys.executable, "-c", "import kvtier.daemon.server.daemon"]

    def start_daemon() -> float:
        work = Path(tempfile.mkdtemp(prefix="kvtier-bench-start-", dir=work_dir))  # removed by running()
        daemon = BenchDaemon(work, ["--rest", "off", "--host-bytes", str(host_bytes),
                                                "--disk-bytes", str(64 * MIB)], suite="dataplane")
        t0 = time.perf_counter()
        with daemon.running():
            return time.perf_counter() - t0

    def start_imports() -> float:
        t0 = time.perf_counter()
        subprocess.run(imports, check=True, env=child_env(), stdout=subprocess.DEVNULL)
        return time.perf_counter() - t0

    kv, base = alternate(start_daemon, start_imports, repetitions=reps, warmup=0)
    return latency_row(f"start to ready, {host_bytes / MIB:g} MiB host tier", "latency", "s", kv,
                       "python importing the daemon's modules", base)


# --- the daemon --------------------------------------------------------------------------------


def _daemon(work: Path, host_bytes: int, profile: str | None) -> BenchDaemon:
    """The daemon under test: unix socket and TCP, no REST, a small disk tier."""
    flags = ["--listen", "127.0.0.1:0", "--rest", "off", "--host-bytes", str(host_bytes),
             "--disk-bytes", str(64 * MIB), "--token-file", str(work / "token")]
    return BenchDaemon(work, flags, suite="dataplane", profile=profile)


# --- blocks ------------------------------------------------------------------------------------


def _record(key: bytes, parent: bytes | None, payload: bytes) -> bytearray:
    """One whole block record: encoded header, then ``payload`` (a writable buffer, for torch)."""
    n = len(payload)
    h = BlockHeader(ns_id=NS, chain_hash=key, parent_hash=parent, num_tokens=16, layout="canonical",
                    shape=(1, 2, 1, 16, n // 64), dtype="float16", codec="raw",
                    sections=(Section("payload", 0, n),), payload_len=n, checksum=payload_checksum(payload))
    return bytearray(encode_header(h) + payload)


def _rekey(records: list[bytearray], hashes: list[bytes], salt: bytes) -> None:
    """Give every record (and ``hashes``, in place) a new chain of keys, rewriting only the header
    bytes in front of each payload: every repetition then saves blocks the daemon has never seen,
    headers included (no decode memo helps), without copying the payloads again."""
    for i, record in enumerate(records):
        h, off = decode_header(record)
        key = hashlib.sha256(salt + h.chain_hash).digest()
        header = encode_header(replace(h, chain_hash=key, parent_hash=hashes[i - 1] if i else None))
        assert len(header) == off, "a new key of the same length re-encodes to the same length"
        record[:off] = header
        hashes[i] = key


def _batches(n: int, per: int) -> list[range]:
    return [range(i, min(n, i + per)) for i in range(0, n, per)]


@contextmanager
def _daemon_cpu(read: Callable[[], float | None], out: list[float], blocks: int) -> Iterator[None]:
    """Append to ``out`` the daemon's CPU time per block, in µs, over the ``with`` block (nothing
    where it cannot be read). Read outside the timed part: each reading costs ~0.1 ms."""
    before = read()
    yield
    after = read()
    if before is not None and after is not None:
        out.append((after - before) / blocks * 1e6)


def _block_rows(shm: Client, behind: Client, tcp: Client, nbytes: int, ws: int, batch: int, reps: int,
                threads: int, daemon_cpu: Callable[[], float | None], label: str | None = None) -> list[Row]:
    """The put/get rows of blocks of ``nbytes``, ``batch`` bytes of them per call, rotating over
    ``ws`` bytes; ``label`` names them in the cases (default: the block size)."""
    n = max(2, ws // nbytes)
    label = label or f"{nbytes / MIB:g}MiB"
    progress(f"dataplane: {label} blocks, {n} in rotation ({n * nbytes / MIB:g} MiB per side)")
    gen = torch.Generator().manual_seed(nbytes)
    hashes = [hashlib.sha256(NS + nbytes.to_bytes(8, "little") + i.to_bytes(8, "little")).digest()
              for i in range(n)]
    records = [_record(hashes[i], hashes[i - 1] if i else None,
                       torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).numpy().tobytes())
               for i in range(n)]
    srcs = [torch.frombuffer(r, dtype=torch.uint8)[len(r) - nbytes:] for r in records]  # payloads
    dsts = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]
    groups = _batches(n, max(1, batch // nbytes))
    rep = iter(range(1 << 30))
    src_views = [s.numpy() for s in srcs]
    dst_views = [d.numpy() for d in dsts]
    into = [[dst_views[i] for i in g] for g in groups]  # the baseline's destinations

    froms = [[src_views[i] for i in g] for g in groups]

    def memcpy(streaming: bool = True) -> float:  # batch by batch, as the client copies
        with Timer() as t:
            for d, s in zip(into, froms):
                memcopy.copy_many_threads(d, s, threads, streaming=streaming)
        return gbps(n * nbytes, t.seconds)

    def glibc() -> float:
        return memcpy(streaming=False)

    def torch_copy() -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with Timer() as t:
                for s, d in zip(srcs, dsts):
                    d.copy_(s)
        finally:
            torch.set_num_threads(before)
        return gbps(n * nbytes, t.seconds)

    def put(client: Client, cpu: list[float]) -> Callable[[], float]:
        def once() -> float:
            _rekey(records, hashes, next(rep).to_bytes(4, "little"))  # untimed
            blocks = [[(hashes[i], records[i]) for i in g] for g in groups]
            with _daemon_cpu(daemon_cpu, cpu, n), Timer() as t:
                for b in blocks:
                    out = client.save(NS, b)
                    assert out == ["stored"] * len(b), f"bench save answered {set(out)}"
                client.flush()  # write-behind: every commit confirmed (a no-op otherwise)
            client.delete(NS, hashes)  # untimed: the next repetition stores new blocks again
            return gbps(n * nbytes, t.seconds)
        return once

    def get(client: Client, cpu: list[float]) -> Callable[[], float]:
        keys = [[hashes[i] for i in g] for g in groups]

        def once() -> float:
            got = 0
            with _daemon_cpu(daemon_cpu, cpu, n), Timer() as t:
                for k, bufs in zip(keys, into):
                    got += len(client.load_into(NS, k, bufs, degrade=False))
            assert got == n, f"bench load found {got} of {n} blocks"
            return gbps(n * nbytes, t.seconds)
        return once

    plural = threads_label(threads)
    base_name = f"memcpy ({'kvtier.client.memcopy, non-temporal' if memcopy.NONTEMPORAL else 'plain'}, {plural})"
    torch_name = f"torch copy_ ({plural})"
    glibc_name = f"memcpy (glibc, {plural})"
    copy_kv, copy_base = alternate(memcpy, torch_copy, repetitions=reps)
    rows = [throughput_row(f"memcpy {label} (kvtier.client.memcopy)", "throughput", "GB/s", copy_kv, torch_name, copy_base)]

    def compare(case: str, fn: Callable[[list[float]], Callable[[], float]]) -> None:
        """``fn`` beside the client's own copy and beside glibc's memcpy, all three alternating;
        and the daemon's CPU time per block it took, beside the time the client's copy of a block
        takes (how much of a core the daemon needs while a client streams blocks)."""
        cpu: list[float] = []
        kv, base, plain = alternate_many([fn(cpu), memcpy, glibc], repetitions=reps)
        rows.append(throughput_row(case, "throughput", "GB/s", kv, base_name, base))
        rows.append(throughput_row(case, "throughput", "GB/s", kv, glibc_name, plain))
        if len(cpu) > 1:  # cpu[0]: alternate_many's warm-up
            copy_us = Samples([nbytes / (g * 1e3) for g in base.values])
            rows.append(latency_row(f"{case}, daemon CPU", "cpu per block", "us", Samples(cpu[1:]),
                                    f"the client's copy of a block ({plural})", copy_us))

    for name, client, suffix in (("shm", shm, ""), ("shm", behind, ", write-behind"), ("tcp", tcp, "")):
        compare(f"{name} put {label}{suffix}", lambda cpu, c=client: put(c, cpu))
    _rekey(records, hashes, b"get")
    for g in groups:  # untimed: what the gets read
        shm.save(NS, [(hashes[i], records[i]) for i in g])
    # Loads of a stored prefix come later than its save; by then the daemon has checked each
    # block once (kvtier.daemon.store.scrub, within MAX_DELAY_S) and readers copy without hashing.
    time.sleep(MAX_DELAY_S + 0.5)
    for name, client in (("shm", shm), ("tcp", tcp)):
        compare(f"{name} get {label}", lambda cpu, c=client: get(c, cpu))
        loaded = client.load(NS, [hashes[i] for i in groups[0]], degrade=False)
        assert loaded == [bytes(records[i]) for i in groups[0]], f"{name} load returned other bytes"
        for d in dsts:
            d.zero_()
        assert len(client.load_into(NS, hashes, [d.numpy() for d in dsts], degrade=False)) == n
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)), f"{name} load_into copied other bytes"
    shm.delete(NS, hashes)
    return rows


# --- lookup ------------------------------------------------------------------------------------


def _lookup_rows(shm: Client, tcp: Client, num_keys: int, calls: int, reps: int) -> list[Row]:
    rng = random.Random(num_keys)
    tokens = [rng.randrange(1 << 17) for _ in range(num_keys * LOOKUP_HASH_TOKENS)]
    hashes = chain_hashes(tokens, LOOKUP_HASH_TOKENS)
    progress(f"dataplane: lookup of {len(hashes)} keys ({len(tokens) // 1024}K tokens), "
             f"{calls} calls per repetition")
    payload = bytes(LOOKUP_PAYLOAD)
    shm.save(NS, [(h, _record(h, hashes[i - 1] if i else None, payload)) for i, h in enumerate(hashes)])
    for client in (shm, tcp):
        found = client.lookup(NS, hashes, degrade=False)
        assert found.num_hits == len(hashes), f"bench lookup found {found.num_hits} of {len(hashes)} keys"
    index = {h: i for i, h in enumerate(hashes)}
    with Timer() as t:
        for _ in range(calls):
            sum(1 for h in hashes if h in index)
    progress(f"dataplane: in-process dict walk of the same keys: {t.seconds / calls * 1e3:.4f} ms per call")
    rows: list[Row] = []
    for name, client in (("unix socket", shm), ("tcp", tcp)):
        rows += ping_latency_rows(f"lookup {len(hashes)} keys, {name}, vs ping",
                                  lambda c=client: c.lookup(NS, hashes, degrade=False), client.ping, calls, reps)
    shm.clear(NS)
    return rows


__all__ = ["DESCRIPTION", "add_arguments", "run"]
