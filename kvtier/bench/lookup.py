"""`kvtier bench lookup`: longest-prefix lookup through the daemon, and the index at 1K–1M blocks.

Rows:
  * ``daemon lookup`` p50 / p99 (ms) per prompt length (``--prompt-tokens``, default 1K…128K
    tokens, one key per ``--block-tokens`` = 256 tokens, so 4…512 keys): ``Client.lookup`` over
    the unix socket of a real ``kvtier serve`` subprocess, every key stored (the daemon walks
    them all), next to a ``ping`` over the same socket: the round trip every call pays.
  * ``index walk`` throughput (Mkeys/s) with 100K and 1M blocks stored (``--stored``), next to
    the same walk with 1K stored: a ratio of 1.0 is flat. The index is a
    :class:`kvtier.daemon.store.index.BlockIndex` built in this process (add → commit → place in the
    host tier, as the store does), not through the daemon: a daemon holding 1M blocks needs 1M
    host slots and a million puts, while lookup touches only the index. Each walk is
    ``BlockIndex.lookup_names`` of ``--walk-tokens`` (128K) tokens of keys, built fresh for each
    call as the daemon's key check builds them (``ns_id + hash``), all of them hits. Two key
    patterns: ``hot`` (one prompt again and again: its entries stay in the CPU cache) and
    ``random`` (a prompt at a random position among every stored block: each key is a cache miss
    once the index outgrows the cache, the worst case). A ``dict floor`` row puts the random walk
    at the largest size next to a plain ``dict.get`` walk of a dict of the same keys: what the
    Python hash table alone costs at that size; the ``dict.get walk`` row is that plain dict's
    own flatness (largest vs smallest size), the floor any Python index sits on.
  * ``index memory`` (bytes per block): what the index holds per committed block, measured with
    tracemalloc while building the index of the middle ``--stored`` size (100K), with and
    without the block's encoded header (the index keeps it for ``acquire``), and as the RSS delta
    of building the largest; baseline the 16 + 32-byte key itself. Blocks are in the host tier
    only; a copy on disk too adds one more LRU entry per block.

Each block's header is a real encoded header (kvtier_protocol.header) of the declared shape, with
the block's own chain hash written in; the index never parses it, so only its length matters.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import sys
import tempfile
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.daemon import BenchDaemon
from kvtier.bench.report import (Row, Samples, SuiteResult, Timer, alternate, latency_row, ping_latency_rows,
                                 progress, throughput_row)
from kvtier.client import Client
from kvtier.daemon.store.index import BlockIndex, BlockMeta
from kvtier.daemon.store.types import Slot, Tier
from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum

DESCRIPTION = "longest-prefix lookup latency for 1K-128K-token prompts; flat with 1K-1M blocks stored"
MIB = 1 << 20
NS = hashlib.sha256(b"kvtier bench lookup").digest()[:16]
KEY_BYTES = 16 + 32  # ns_id || chain_hash: the baseline of the memory rows
DAEMON_PAYLOAD = 4096  # small records: the daemon rows measure the index walk, not memory
INDEX_SHAPE = (32, 2, 8, 256, 128)  # a Llama-3-8B block of 256 tokens in bfloat16: 32 MiB
INDEX_PAYLOAD = 32 * 2 * 8 * 256 * 128 * 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", default=None,
                        help="prompt lengths of the daemon rows (default 1K,4K,16K,32K,64K,128K; --quick 1K,16K,128K)")
    parser.add_argument("--block-tokens", type=int, default=256, help="tokens per stored block (one key each)")
    parser.add_argument("--calls", type=int, default=None,
                        help="daemon lookups (and pings) per repetition (default 1000; --quick 100)")
    parser.add_argument("--stored", default=None,
                        help="index sizes in blocks, the first is the reference (default 1K,100K,1M; --quick 1K,10K,20K)")
    parser.add_argument("--walk-tokens", default="128K", help="tokens of keys per index walk (default 128K)")
    parser.add_argument("--walks", type=int, default=None,
                        help="index walks per repetition (default 2000; --quick 200)")
    parser.add_argument("--work-dir", default=None, help="parent of the daemon's temp dir (default $TMPDIR)")


def parse_count(text: str) -> int:
    """``"128K"`` → 131072, ``"1M"`` → 1048576 for tokens; blocks use the same suffixes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def label(n: int) -> str:
    """1024 → ``"1K"``, 1048576 → ``"1M"`` (inverse of :func:`parse_count` for round sizes)."""
    for suffix, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def run(args: argparse.Namespace) -> SuiteResult:
    reps = args.repetitions or (2 if args.quick else 5)
    prompts = [parse_count(x) for x in (args.prompt_tokens or ("1K,16K,128K" if args.quick
                                                                else "1K,4K,16K,32K,64K,128K")).split(",")]
    stored = [parse_count(x) for x in (args.stored or ("1K,10K,20K" if args.quick else "1K,100K,1M")).split(",")]
    calls = args.calls or (100 if args.quick else 1000)
    walks = args.walks or (200 if args.quick else 2000)
    walk_keys = max(1, parse_count(args.walk_tokens) // args.block_tokens)
    if args.block_tokens < 1 or min(prompts) < args.block_tokens or min(stored) < walk_keys:
        raise SystemExit(f"lookup: prompts need at least one block of {args.block_tokens} tokens and every "
                         f"index size at least {walk_keys} blocks (one walk)")
    result = SuiteResult("lookup")
    result.rows += _daemon_rows(prompts, args.block_tokens, calls, reps, args.work_dir)
    result.rows += _index_rows(stored, walk_keys, args.block_tokens, walks, reps)
    return result


# --- through the daemon ------------------------------------------------------------------------


def _chain(seed: bytes, n: int) -> list[bytes]:
    """``n`` distinct 32-byte chain hashes (the index does not care how they were derived)."""
    return [hashlib.blake2b(seed + i.to_bytes(8, "little"), digest_size=32).digest() for i in range(n)]


def _record(key: bytes, parent: bytes | None, payload: bytes) -> bytes:
    n = len(payload)
    h = BlockHeader(ns_id=NS, chain_hash=key, parent_hash=parent, num_tokens=16, layout="canonical",
                    shape=(1, 2, 1, 16, n // 64), dtype="float16", codec="raw",
                    sections=(Section("payload", 0, n),), payload_len=n, checksum=payload_checksum(payload))
    return encode_header(h) + payload


def _daemon_rows(prompts: list[int], block_tokens: int, calls: int, reps: int, work_dir: str | None) -> list[Row]:
    hashes = _chain(b"daemon", max(prompts) // block_tokens)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-lk-", dir=work_dir))
    host_bytes = len(hashes) * (DAEMON_PAYLOAD + 4096) + 64 * MIB
    daemon = BenchDaemon(work, ["--rest", "off", "--host-bytes", str(host_bytes), "--disk-bytes", str(64 * MIB)],
                         suite="lookup")
    rows: list[Row] = []
    with daemon.running():
        with Client.connect(daemon.address, timeout_s=60.0) as client:
            payload = bytes(DAEMON_PAYLOAD)
            for i in range(0, len(hashes), 256):
                client.save(NS, [(h, _record(h, hashes[j - 1] if j else None, payload))
                                 for j, h in enumerate(hashes[i:i + 256], start=i)])
            for tokens in prompts:
                keys = hashes[:tokens // block_tokens]
                found = client.lookup(NS, keys, degrade=False)
                if found.num_hits != len(keys):
                    raise RuntimeError(f"lookup: the daemon found {found.num_hits} of {len(keys)} stored keys")
                progress(f"lookup: daemon, {label(tokens)}-token prompt ({len(keys)} keys), {calls} calls x {reps}")
                rows += ping_latency_rows(f"daemon lookup {label(tokens)} tokens ({len(keys)} keys), unix socket",
                                      lambda k=keys: client.lookup(NS, k, degrade=False), client.ping, calls, reps)
    return rows


# --- the index in process ----------------------------------------------------------------------


@dataclass(slots=True)
class BuiltIndex:
    """An index of ``len(hashes)`` committed host blocks, and what building it cost."""

    index: BlockIndex
    hashes: list[bytes]
    traced_bytes: int  # growth of the memory tracemalloc traced while building (0: not traced)
    header_bytes: int  # bytes of the header objects it holds (sys.getsizeof each)
    rss_bytes: int  # RSS growth while building


def _header_template() -> tuple[bytes, int]:
    """A real encoded header of :data:`INDEX_SHAPE`, and where its chain hash sits in it."""
    marker = bytes(range(32))
    h = BlockHeader(ns_id=NS, chain_hash=marker, parent_hash=bytes(32), num_tokens=INDEX_SHAPE[3],
                    layout="canonical", shape=INDEX_SHAPE, dtype="bfloat16", codec="raw",
                    sections=(Section("payload", 0, INDEX_PAYLOAD),), payload_len=INDEX_PAYLOAD, checksum=1)
    enc = encode_header(h)
    at = enc.find(marker)
    assert at > 0 and enc.count(marker) == 1, "the chain hash appears once in the header"
    return enc, at


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def build_index(n: int, *, trace: bool = False) -> BuiltIndex:
    """``n`` committed blocks, each in the host tier, as :class:`TieredStore` leaves them."""
    template, at = _header_template()
    hashes = _chain(b"index", n)
    index = BlockIndex({Tier.HOST: 1 << 62, Tier.DISK: 1 << 62}, num_classes=4)
    gc.collect()
    rss = _rss_bytes()
    if trace:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if trace else 0
    header_bytes = 0
    gc.disable()  # a million container allocations would trigger needless full collections
    try:
        for i, h in enumerate(hashes):
            header = template[:at] + h + template[at + 32:]
            header_bytes += sys.getsizeof(header)
            meta = BlockMeta(NS + h, INDEX_PAYLOAD)
            index.add(meta)
            # The daemon's parent hash is its own object, decoded from the header: copy, not share.
            parent = bytes(memoryview(hashes[i - 1])) if i else None
            index.commit(meta, header, parent, INDEX_SHAPE[3], i, 0.0)
            index.place(meta, Tier.HOST, Slot(0, i * INDEX_PAYLOAD, INDEX_PAYLOAD))
    finally:
        gc.enable()
    traced = tracemalloc.get_traced_memory()[0] - before if trace else 0
    if trace:
        tracemalloc.stop()
    return BuiltIndex(index, hashes, traced, header_bytes, _rss_bytes() - rss)


def _walker(built: BuiltIndex, walk_keys: int, walks: int, pattern: str) -> Callable[[], float]:
    """One measurement: ``walks`` lookups of ``walk_keys`` keys; returns Mkeys/s."""
    hashes, index = built.hashes, built.index
    rng = random.Random(len(hashes))
    last = len(hashes) - walk_keys

    def once() -> float:
        starts = [0] * walks if pattern == "hot" else [rng.randrange(last + 1) for _ in range(walks)]
        ns, lookup_names = NS, index.lookup_names
        with Timer() as t:
            for s in starts:
                hits = lookup_names([ns + h for h in hashes[s:s + walk_keys]])
                if len(hits) != walk_keys:
                    raise RuntimeError(f"lookup: the index walk found {len(hits)} of {walk_keys} keys")
        return walks * walk_keys / t.seconds / 1e6
    return once


def _dict_walker(built: BuiltIndex, walk_keys: int, walks: int) -> Callable[[], float]:
    """The floor: the same random walk over a plain dict of the same keys (value: the meta),
    stopping at a miss but reading nothing from the value."""
    table = {m.key: m for m in built.index.blocks()}
    hashes = built.hashes
    rng = random.Random(len(hashes) + 1)
    last = len(hashes) - walk_keys

    def once() -> float:
        starts = [rng.randrange(last + 1) for _ in range(walks)]
        ns, get = NS, table.get
        with Timer() as t:
            for s in starts:
                out = []
                for key in [ns + h for h in hashes[s:s + walk_keys]]:
                    meta = get(key)
                    if meta is None:
                        break
                    out.append(meta)
        return walks * walk_keys / t.seconds / 1e6
    return once


def _index_rows(stored: list[int], walk_keys: int, block_tokens: int, walks: int, reps: int) -> list[Row]:
    ref_n, sizes = stored[0], stored[1:]
    traced_n = sizes[0] if sizes else ref_n
    built: dict[int, BuiltIndex] = {}
    for n in stored:
        progress(f"lookup: building an index of {label(n)} blocks in process"
                 f"{' (traced by tracemalloc)' if n == traced_n else ''}")
        with Timer() as t:
            built[n] = build_index(n, trace=n == traced_n)
        progress(f"lookup: {label(n)} blocks built in {t.seconds:.1f} s "
                 f"({t.seconds / n * 1e6:.1f} µs per add+commit+place)")
    walk = f"index walk {walk_keys} keys ({label(walk_keys * block_tokens)} tokens)"
    rows: list[Row] = []
    ref_name = f"same walk, {label(ref_n)} stored"
    for n in sizes:
        for pattern in ("hot", "random"):
            progress(f"lookup: {walk}, {label(n)} vs {label(ref_n)} stored, {pattern}")
            kv, base = alternate(_walker(built[n], walk_keys, walks, pattern),
                                 _walker(built[ref_n], walk_keys, walks, pattern), repetitions=reps)
            rows.append(throughput_row(f"{walk}, {label(n)} stored, {pattern}", "throughput", "Mkeys/s",
                                       kv, ref_name, base))
    top = stored[-1]
    progress(f"lookup: {walk}, {label(top)} stored, random, vs a plain dict of the same keys")
    kv, base = alternate(_walker(built[top], walk_keys, walks, "random"), _dict_walker(built[top], walk_keys, walks),
                         repetitions=reps)
    rows.append(throughput_row(f"{walk}, {label(top)} stored, random (dict floor)", "throughput", "Mkeys/s",
                               kv, "dict.get walk, same keys", base))
    progress(f"lookup: plain dict walk, {label(top)} vs {label(ref_n)} entries, random: the floor's own flatness")
    kv, base = alternate(_dict_walker(built[top], walk_keys, walks), _dict_walker(built[ref_n], walk_keys, walks),
                         repetitions=reps)
    rows.append(throughput_row(f"dict.get walk {walk_keys} keys (no index), {label(top)} entries, random", "throughput",
                               "Mkeys/s", kv, f"same walk, {label(ref_n)} entries", base))
    traced = built[traced_n]
    n = len(traced.hashes)
    key = Samples([float(KEY_BYTES)])
    rows.append(latency_row(f"index memory, {label(n)} blocks, with headers (tracemalloc)", "per block", "B",
                            Samples([traced.traced_bytes / n]), "16+32-byte key", key))
    rows.append(latency_row(f"index memory, {label(n)} blocks, without headers (tracemalloc)", "per block", "B",
                            Samples([(traced.traced_bytes - traced.header_bytes) / n]), "16+32-byte key", key))
    # tracemalloc's own bookkeeping would inflate an RSS delta, so it is taken on an untraced
    # build. It counts only pages the build added: at small sizes the heap that earlier phases
    # freed can hold the whole index and the delta reads 0 — a lower bound, meaningful from ~100K.
    if top != traced_n:
        rows.append(latency_row(f"index memory, {label(top)} blocks, with headers (RSS delta)", "per block", "B",
                                Samples([built[top].rss_bytes / top]), "16+32-byte key", key))
    return rows


__all__ = ["DESCRIPTION", "BuiltIndex", "add_arguments", "build_index", "label", "parse_count",
           "run"]
