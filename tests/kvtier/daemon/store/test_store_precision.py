"""Precision by tier (issue 25): raw host blocks re-encoded on their way to disk, exact-only reads.

Real stores (shared-memory host tier, RocksDB + O_DIRECT disk tier) and real records
(:func:`kvtier_protocol.block.encode_block`); a crash is a real SIGKILL of a process demoting
blocks, and the store that reopens its disk tier and adopts its host tier shows what is left.
"""

from __future__ import annotations

import glob
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.header import decode_header, split_record
from kvtier_protocol.layouts import to_canonical
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.store.shm import SHM_DIR
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.store.storekit import NS, Rec, chain, get, put

ROOT = Path(__file__).resolve().parents[4]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("", "protocol", "connectors"))}


def kv_rec(i: int, x: torch.Tensor, *, layout: str = "canonical", ns: bytes = NS, codec: str = "raw",
           rope: int = 0) -> Rec:
    """Block ``i`` of a chain in ``ns`` holding ``x`` (in ``layout``), encoded with ``codec``."""
    record = encode_block(x, ns_id=ns, chain_hash=chain(i, ns), parent_hash=chain(i - 1, ns) if i else None,
                          layout=layout, codec=codec, mla_rope_dim=rope)
    h, payload = split_record(record)
    return Rec(ns, h.chain_hash, record[:len(record) - h.payload_len], bytes(payload))


def kv(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """KV-like values: normal, with a per-block scale and offset over six decades, a few outliers."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(shape, generator=g) * 10 ** rng.uniform(-3, 3) + rng.uniform(-1, 1)
    x.view(-1)[rng.randrange(x.numel())] *= 20  # an outlier channel value widens one group's range
    return x.to(dtype)


def int8_bound(x: torch.Tensor, *, mla: bool, rope: int) -> torch.Tensor:
    """SPEC 5.4's error per element of int8 with the default groups (MHA: K per channel over the
    block's tokens, V per token over its channels; MLA: per token, one group of <= 128 latent dims):
    S/2, plus the float16 rounding of S (times the code, at most 255) and of M, plus the rounding
    of the decoded float32 to the block's dtype (bfloat16: 2^-8 relative; 2^-7 taken)."""
    xf = x.float()
    if mla:
        part = xf[..., : xf.shape[-1] - rope]
        assert part.shape[-1] <= 128, "one group per token in these tests"
        groups = [(part, 2)]
    else:
        groups = [(xf[:, 0], 2), (xf[:, 1], 3)]
    bounds = []
    for part, dim in groups:
        mn, mx = part.amin(dim, keepdim=True), part.amax(dim, keepdim=True)
        s = (mx - mn) / 255
        bounds.append((s * (0.5 + 255 * 2**-11) + mn.abs() * 2**-11 + part.abs() * 2**-7).expand_as(part))
    if mla:
        return torch.cat([bounds[0], torch.zeros_like(xf[..., xf.shape[-1] - rope:])], -1)
    return torch.stack(bounds, 1)


def block_ids(store, recs: list[Rec]) -> list[list[Tier]]:
    return [store.info(r.ns_id, r.chain_hash).tiers for r in recs]


CASES = [  # (layout, dtype, shape of one block in that layout, MLA rope dims)
    ("canonical", torch.bfloat16, (2, 2, 4, 16, 32), 0),
    ("canonical", torch.float16, (1, 2, 2, 16, 64), 0),
    ("canonical", torch.float32, (3, 2, 1, 16, 16), 0),
    ("vllm-flash", torch.bfloat16, (2, 2, 16, 4, 32), 0),  # [L, 2, T, H, D]: converted, stored canonical
    ("mla-latent", torch.bfloat16, (2, 16, 72), 8),  # rope dims from the registered namespace, kept raw
]


@pytest.mark.parametrize("layout,dtype,shape,rope", CASES, ids=[f"{c[0]}-{c[1]}".replace("torch.", "") for c in CASES])
async def test_raw_to_int8_on_demotion_decodes_within_the_codec_error_and_keeps_the_key(
        open_store, layout, dtype, shape, rope):
    rng = random.Random(f"{layout}{dtype}")
    ns_id, namespace = NS, None
    if layout == "mla-latent":  # the store knows the rope dims from the block's registered namespace
        L, T, C = shape
        namespace = Namespace(model="m", revision="r", attention="mla", num_layers=L, num_kv_heads=1,
                              head_dim=C - rope, head_dim_v=0, mla_rope_dim=rope, kv_dtype="bfloat16")
        ns_id = namespace.ns_id
    xs = [kv(rng, shape, dtype) for _ in range(10)]
    recs = [kv_rec(i, x, layout=layout, ns=ns_id) for i, x in enumerate(xs)]
    size = len(recs[0].payload)
    store = await open_store(host_bytes=3 * size, host_segment_bytes=3 * size, disk_codec="int8")
    if namespace is not None:
        store.register_namespace(namespace)
    for r in recs:  # one at a time: each put evicts the least recent host block to disk
        assert await put(store, [r]) == [True]
    demoted = [i for i, tiers in enumerate(block_ids(store, recs)) if tiers == [Tier.DISK]]
    assert len(demoted) >= 7 and demoted == list(range(len(demoted))), block_ids(store, recs)  # the oldest
    disk = store.counters.tiers[Tier.DISK]  # what the metrics export (kvtier_tier_recoded_*)
    assert disk.recoded == len(demoted) and disk.recode_seconds > 0
    assert disk.recoded_saved_bytes == sum(
        size - decode_header(store.disk.get(make_key(ns_id, recs[i].chain_hash)))[0].payload_len for i in demoted)

    for i in demoted:
        record = store.disk.get(make_key(ns_id, recs[i].chain_hash))
        h, y = decode_block(record)  # verifies the new payload checksum
        old, _ = decode_header(recs[i].header)
        assert (h.codec, h.quant.bits, h.layout) == ("int8", 8, "mla-latent" if rope else "canonical")
        assert (h.ns_id, h.chain_hash, h.parent_hash, h.num_tokens, h.dtype) == \
            (old.ns_id, old.chain_hash, old.parent_hash, old.num_tokens, old.dtype)  # same block, same key
        assert h.payload_len < size  # what the disk holds shrank
        # The very bytes the protocol's own encoder writes for this tensor...
        want = kv_rec(i, xs[i], layout=layout, ns=ns_id, codec="int8", rope=rope)
        assert record == want.header + want.payload
        # ...and within SPEC 5.4's error of the original.
        x = to_canonical(xs[i], layout)
        err = (y.double() - x.double()).abs()
        assert bool((err <= int8_bound(x, mla=bool(rope), rope=rope).double()).all()), float(err.max())
        if rope:
            assert torch.equal(y[..., -rope:], x[..., -rope:])  # rope dims stored raw

    # A promotion back into host keeps the stored codec: the host copy is the disk record, lossy.
    for i in [i for i in range(10) if i not in demoted] + demoted:  # one at a time; the host blocks first
        (header, payload), = await get(store, ns_id, [recs[i].chain_hash])
        if i in demoted:
            assert header + payload == store.disk.get(make_key(ns_id, recs[i].chain_hash))
            assert decode_header(header)[0].codec == "int8"
        else:
            assert (header, payload) == (recs[i].header, recs[i].payload)  # never demoted: exact
    assert (await store.check()).ok


async def test_lz4_after_the_disk_codec_is_lossless(open_store):
    rng = random.Random(7)
    xs = [kv(rng, (2, 2, 2, 16, 64), torch.bfloat16) for _ in range(4)]
    recs = [kv_rec(i, x) for i, x in enumerate(xs)]
    size = len(recs[0].payload)
    store = await open_store(host_bytes=2 * size, host_segment_bytes=2 * size, disk_codec="int8",
                             disk_compression="lz4")
    for r in recs:
        await put(store, [r])
    for i in (0, 1):
        h, y = decode_block(store.disk.get(make_key(NS, recs[i].chain_hash)))
        assert h.codec == "int8" and h.compression is not None
        _, want = decode_block(encode_block(xs[i], ns_id=NS, chain_hash=h.chain_hash, parent_hash=h.parent_hash,
                                            layout="canonical", codec="int8"))
        assert torch.equal(y, want)


async def test_the_default_disk_codec_writes_records_as_they_are(open_store):
    rng = random.Random(3)
    recs = [kv_rec(i, kv(rng, (2, 2, 2, 16, 32), torch.bfloat16)) for i in range(5)]
    size = len(recs[0].payload)
    store = await open_store(host_bytes=2 * size, host_segment_bytes=2 * size)
    assert store.config.disk_codec == "raw"
    for r in recs:
        await put(store, [r])
    for r in recs[:3]:
        assert store.disk.get(make_key(NS, r.chain_hash)) == r.header + r.payload
    assert store.counters.tiers[Tier.DISK].recoded == 0
    for r in recs:  # one at a time: two fit in host
        assert await get(store, NS, [r.chain_hash]) == [(r.header, r.payload)]


async def test_records_the_codec_cannot_take_go_down_as_they_are(open_store):
    rng = random.Random(5)
    nan = kv(rng, (1, 2, 2, 16, 32), torch.bfloat16)
    nan[0, 1, 0, 3, 5] = float("nan")  # the quantizing codecs refuse NaN and Inf
    ints = torch.randint(-100, 100, (1, 2, 2, 16, 64), dtype=torch.int8)  # not float KV
    already = kv_rec(2, kv(rng, (1, 2, 2, 16, 32), torch.bfloat16), codec="int4")  # lossy already: kept
    mla = kv_rec(3, kv(rng, (2, 16, 64), torch.bfloat16), layout="mla-latent")  # rope dims unknown: kept
    recs = [kv_rec(0, nan), kv_rec(1, ints), already, mla, kv_rec(4, kv(rng, (1, 2, 2, 16, 32), torch.bfloat16))]
    store = await open_store(host_bytes=4096, host_segment_bytes=4096, disk_codec="int8")
    for r in recs:
        assert await put(store, [r]) == [True]
    for r in recs[:4]:
        assert store.info(NS, r.chain_hash).tiers == [Tier.DISK]
        assert store.disk.get(make_key(NS, r.chain_hash)) == r.header + r.payload


async def test_accept_lossy_false_ends_the_prefix_at_the_first_lossy_copy(open_store):
    rng = random.Random(11)
    recs = [kv_rec(i, kv(rng, (2, 2, 2, 16, 32), torch.bfloat16)) for i in range(6)]
    size = len(recs[0].payload)
    store = await open_store(host_bytes=4 * size, host_segment_bytes=4 * size, disk_codec="int8")
    for r in reversed(recs):  # the last blocks of the prefix go in first, so they are the ones demoted
        await put(store, [r])
    hashes = [r.chain_hash for r in recs]
    assert block_ids(store, recs)[4:] == [[Tier.DISK], [Tier.DISK]]

    assert store.lookup_names(NS, hashes) == (6, ["host"] * 4 + ["disk"] * 2)  # the default: any copy
    assert store.lookup_names(NS, hashes, accept_lossy=False) == (4, ["host"] * 4)
    assert store.lookup_names(NS, hashes, accept_lossy=True)[0] == 6
    assert await store.lookup_remote(NS, hashes, accept_lossy=False) == (4, ["host"] * 4)
    acq = await store.acquire(NS, hashes, accept_lossy=False)
    assert [b.chain_hash for b in acq.blocks] == hashes[:4]
    assert all(decode_header(b.header)[0].codec == "raw" for b in acq.blocks)
    assert store.release(acq.lease_id)
    acq = await store.acquire(NS, hashes[4:], accept_lossy=False)
    assert acq.blocks == [] and acq.lease_id == 0
    # Promoted into host, a lossy copy stays lossy: still a miss for an exact-only request.
    (header, _), = await get(store, NS, hashes[4:5])
    assert decode_header(header)[0].codec == "int8" and Tier.HOST in store.info(NS, hashes[4]).tiers
    assert store.lookup_names(NS, hashes[4:], accept_lossy=False) == (0, [])
    assert store.lookup_names(NS, hashes[4:])[0] == 2


async def test_accept_lossy_defaults_to_the_store_config_and_sees_a_writers_codec(open_store):
    rng = random.Random(13)
    raw = [kv_rec(i, kv(rng, (1, 2, 2, 16, 32), torch.bfloat16)) for i in range(2)]
    lossy = kv_rec(2, kv(rng, (1, 2, 2, 16, 32), torch.bfloat16), codec="int8")  # the writer's own codec
    store = await open_store(accept_lossy=False)
    assert await put(store, raw + [lossy]) == [True] * 3
    hashes = [r.chain_hash for r in raw + [lossy]]
    assert store.lookup_names(NS, hashes)[0] == 2  # the store's default: exact copies only
    assert store.lookup_names(NS, hashes, accept_lossy=True)[0] == 3  # a request may ask for any
    acq = await store.acquire(NS, hashes)
    assert len(acq.blocks) == 2
    store.release(acq.lease_id)
    acq = await store.acquire(NS, hashes, accept_lossy=True)
    assert len(acq.blocks) == 3
    store.release(acq.lease_id)


_CHILD = textwrap.dedent("""
    import asyncio, sys
    from kvtier.daemon.store.config import StoreConfig
    from kvtier.daemon.store.store import TieredStore
    from tests.kvtier.daemon.store.storekit import put
    from tests.kvtier.daemon.store.test_store_precision import crash_rec

    async def main(path, prefix, first):
        size = len(crash_rec(0).payload)
        store = TieredStore(StoreConfig(host_bytes=4 * size, host_segment_bytes=4 * size, host_prefault=False,
                                        host_pin=False, host_name_prefix=prefix, disk_path=path,
                                        disk_bytes=1 << 28, disk_codec="int8"))
        await store.start()
        i = first
        while True:  # until killed: every put past the fourth demotes (re-encodes) one block
            if await put(store, [crash_rec(i)]) == [True]:
                print("ACK", i, flush=True)
            i += 1

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
""")
SHAPE = (4, 2, 4, 16, 64)  # 64 KiB of bfloat16 a block: a re-encode takes long enough to be killed inside


def crash_x(i: int) -> torch.Tensor:
    """The tensor of block ``i`` of the crash test, the same in the child that writes it and here."""
    return kv(random.Random(i), SHAPE, torch.bfloat16)


def crash_rec(i: int, codec: str = "raw") -> Rec:
    return kv_rec(i, crash_x(i), codec=codec)


async def test_a_crash_during_reencoding_leaves_the_old_copy_or_the_new_one(open_store, tmp_path):
    prefix = f"kvtier-recode-{os.getpid()}"
    size = len(crash_rec(0).payload)
    acked: list[int] = []
    try:
        # Three kills at different points of the demotions; each child adopts what the one before left.
        for run, kill_after in enumerate((9, 14, 21)):
            child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "disk"), prefix, str(1000 * run)],
                                     cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                assert child.stdout is not None
                mine = 0
                for line in child.stdout:
                    acked.append(int(line.split()[1]))
                    mine += 1
                    if mine == kill_after:
                        break
                child.send_signal(signal.SIGKILL)  # mid-way through later puts and their demotions
                child.wait(timeout=60)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
                child.stdout.close()
                child.stderr.close()
            assert mine == kill_after, "the child stopped before acknowledging its commits"

        # The host tier adopted (the same segments and layout), the disk tier reopened; its own
        # demotions (reads promote blocks, which evicts others) write raw, so int8 records are the children's.
        store = await open_store(host_bytes=4 * size, host_segment_bytes=4 * size, host_name_prefix=prefix)
        found = {"raw": 0, "int8": 0}
        for i in acked:
            rec = crash_rec(i)
            got = await get(store, NS, [rec.chain_hash])
            assert len(got) == 1, f"acknowledged block {i} lost"
            (header, payload), = got
            h, y = decode_block(header + payload)  # whole: header and payload checksums hold
            if h.codec == "raw":
                assert (header, payload) == (rec.header, rec.payload)  # the old copy, exact
            else:  # the new one: the int8 record of this very block, whole
                new = crash_rec(i, "int8")
                assert (header, payload) == (new.header, new.payload)
            found[h.codec] += 1
        assert found["int8"] > 0 and found["raw"] > 0, found  # re-encoded blocks reached the disk before the kills
        assert (await store.check()).ok
    finally:
        for path in glob.glob(os.path.join(SHM_DIR, prefix + "-*")):
            os.unlink(path)
