"""Faults under the store, each with its designed outcome, and nothing already stored lost or corrupted.

* Disk full: a real ENOSPC from a small tmpfs mounted in a private mount namespace (``unshare -rm``;
  the store runs in that child process). Outcome: a write-through commit is refused (False, a
  storage error counted), everything stored earlier is still served.
* Disk read error: a block file truncated under the running store. Outcome: a miss, counted, the
  record kept; blocks of other files still load.
* A corrupted record: a payload byte and a header byte flipped in the real block files, and a
  header byte flipped in the meta column family through the raw rocksdict API. Outcome: a miss, a
  checksum failure counted, the bad record dropped; the others load intact.
* A slow disk: the real disk write delayed (a wrapper on the real tier: no file system here
  can be slowed). Outcome: lookups and releases keep answering at once; the commit is acknowledged
  once the write returns.
* Host tier exhausted by leases: reserve answers FULL (no error); room comes back with the release.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from kvtier_protocol.errors import StorageError

from kvtier.daemon.store.results import PutStatus
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.store.storekit import BLOCK, NS, get, make_rec, put
from tests.kvtier.waitkit import PATIENCE_S, wait_until_async

ROOT = Path(__file__).resolve().parents[4]
BLOB = 64 << 10  # payload bytes of the blocks whose files are damaged
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("", "protocol", "connectors"))}


# --- disk full (ENOSPC) ---------------------------------------------------------------------------

_FULL_DISK = textwrap.dedent("""
    import asyncio, json, sys
    from kvtier.daemon.store.config import StoreConfig
    from kvtier.daemon.store.store import TieredStore
    from tests.kvtier.daemon.store.storekit import NS, get, make_rec, put

    def config(path, prefix):
        return StoreConfig(host_bytes=1 << 20, host_segment_bytes=1 << 20, host_prefault=False, host_pin=False,
                           host_name_prefix=prefix, disk_path=path, disk_bytes=1 << 30, write_through=True)

    async def main(path, prefix, nbytes):
        out = {}
        store = TieredStore(config(path, prefix))
        await store.start()
        acked = []
        for i in range(10_000):
            ok = await put(store, [make_rec(i, nbytes=nbytes)])
            if ok != [True]:
                out["refused_at"] = i
                break
            acked.append(i)
        out["acked"] = len(acked)
        out["storage_errors"] = store.counters.storage_errors
        out["lookup_after_refusal"] = store.lookup(NS, [make_rec(out.get("refused_at", 0)).chain_hash]).num_hits
        recs = [make_rec(i, nbytes=nbytes) for i in acked]

        async def intact(s):  # one at a time: the 1 MiB host tier holds 4 promoted blocks at most
            n = 0
            for r in recs:
                n += await get(s, NS, [r.chain_hash]) == [(r.header, r.payload)]
            return n

        out["served_intact"] = await intact(store)
        out["check_ok"] = (await store.check()).ok
        try:
            await store.close()
            out["closed"] = True
        except Exception as e:
            out["closed"] = f"{type(e).__name__}: {e}"
        try:
            again = TieredStore(config(path, prefix))
            await again.start()
            out["reopened_intact"] = await intact(again)
            await again.close()
        except Exception as e:
            out["reopened_intact"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out))

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
""")


def _on_small_tmpfs(size: str, nbytes: int, tmp_path: Path) -> dict:
    """Run the full-disk scenario in a private mount namespace over a tmpfs of ``size``."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): cannot mount a small file system to fill")
    mnt = tmp_path / "small"
    mnt.mkdir()
    prefix = f"kvtier-enospc-{os.getpid()}"
    script = (f"mount -t tmpfs -o size={size} tmpfs {mnt} || exit 77; "
              f'exec "{sys.executable}" -c "$0" {mnt}/disk {prefix} {nbytes}')
    try:
        done = subprocess.run(["unshare", "-rm", "sh", "-c", script, _FULL_DISK], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=120)
    finally:
        for path in glob.glob(f"/dev/shm/{prefix}-*"):
            os.unlink(path)
    if done.returncode in (1, 77) and ("unshare" in done.stderr or "mount" in done.stderr or done.returncode == 77):
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_full_disk_refuses_commits_and_keeps_serving_what_was_stored(tmp_path):
    out = _on_small_tmpfs("16m", 256 << 10, tmp_path)
    assert "refused_at" in out  # by the file system: the store's own disk budget is 1 GiB
    assert out["storage_errors"] >= 1
    assert out["lookup_after_refusal"] == 0, "a refused block is not visible"
    assert out["served_intact"] == out["acked"], "every acknowledged block is still served intact"
    assert out["check_ok"]


def test_a_store_that_filled_its_disk_reopens_with_every_acknowledged_block(tmp_path):
    out = _on_small_tmpfs("48m", 1 << 20, tmp_path)  # the disk tier keeps 8 x its 1 MiB memtable free
    assert "refused_at" in out and out["acked"] > 10
    assert out["closed"] is True
    assert out["reopened_intact"] == out["acked"]


# --- disk read errors and corrupted records ----------------------------------------------------------


async def _disk_only(open_store, n: int):
    """``n`` write-through blocks, each in its block file, then evicted from host."""
    store = await open_store(host_bytes=4 * BLOB, host_segment_bytes=4 * BLOB, write_through=True)
    recs = [make_rec(i, nbytes=BLOB) for i in range(n)]
    assert await put(store, recs) == [True] * n
    filler = [make_rec(100 + i, nbytes=BLOB) for i in range(4)]
    assert await put(store, filler) == [True] * 4  # pushes the first blocks out of host
    for r in recs:
        assert store.lookup(NS, [r.chain_hash]).tiers == [Tier.DISK]
    return store, recs, [store.disk.file_path(make_key(NS, r.chain_hash)) for r in recs]


async def test_a_truncated_block_file_is_a_counted_miss_and_other_blocks_load(open_store):
    store, recs, files = await _disk_only(open_store, 3)
    os.truncate(files[1], 0)
    assert await get(store, NS, [recs[1].chain_hash]) == []
    assert store.counters.storage_errors == 1
    for r in (recs[0], recs[2]):
        assert await get(store, NS, [r.chain_hash]) == [(r.header, r.payload)]
    with contextlib.suppress(StorageError):  # see the regression test below
        await store.close()


async def test_a_store_whose_disk_failed_still_closes_and_reopens(open_store):
    store, recs, files = await _disk_only(open_store, 3)
    os.truncate(files[1], 0)
    assert await get(store, NS, [recs[1].chain_hash]) == []
    await store.close()  # designed: a failed flush or close is logged, never raised
    again = await open_store(host_bytes=4 * BLOB, host_segment_bytes=4 * BLOB)  # the database lock is free
    assert await get(again, NS, [recs[0].chain_hash]) == [(recs[0].header, recs[0].payload)]


async def test_check_reports_and_fixes_an_unreadable_record(open_store):
    store, recs, files = await _disk_only(open_store, 3)
    os.truncate(files[1], 0)
    report = await store.check()
    assert (make_key(NS, recs[1].chain_hash), Tier.DISK) in report.corrupt and not report.ok
    await store.check(fix=True)
    assert store.lookup(NS, [recs[1].chain_hash]).num_hits == 0
    assert (await store.check()).ok
    for r in (recs[0], recs[2]):
        assert await get(store, NS, [r.chain_hash]) == [(r.header, r.payload)]
    with contextlib.suppress(StorageError):
        await store.close()


async def test_a_flipped_payload_byte_on_disk_is_a_miss_never_served(open_store):
    store, recs, files = await _disk_only(open_store, 3)
    data = Path(files[1]).read_bytes()
    at = data.find(recs[1].payload[:64])
    assert at >= 0, "the payload lies in the block file as written"
    with open(files[1], "r+b") as f:
        f.seek(at + 1000)
        f.write(bytes([data[at + 1000] ^ 0x01]))
    before = store.counters.checksum_failures
    assert await get(store, NS, [recs[1].chain_hash]) == []
    assert store.counters.checksum_failures == before + 1
    assert store.lookup(NS, [recs[1].chain_hash]).num_hits == 0, "the bad record is dropped"
    assert not store.disk.contains(make_key(NS, recs[1].chain_hash))
    for r in (recs[0], recs[2]):
        assert await get(store, NS, [r.chain_hash]) == [(r.header, r.payload)]
    assert (await store.check()).ok


async def test_a_flipped_header_byte_in_a_block_file_is_a_miss_and_the_rest_load(open_store):
    store, recs, files = await _disk_only(open_store, 3)
    with open(files[2], "r+b") as f:
        f.seek(30)  # inside the msgpack header map, covered by the header checksum
        byte = f.read(1)
        f.seek(30)
        f.write(bytes([byte[0] ^ 0x20]))
    assert await get(store, NS, [r.chain_hash for r in recs]) == [(r.header, r.payload) for r in recs[:2]]
    assert store.counters.checksum_failures == 1
    assert store.lookup(NS, [recs[2].chain_hash]).num_hits == 0
    assert (await store.check()).ok


async def test_a_flipped_header_byte_in_rocksdb_meta_drops_the_block_at_start(open_store, tmp_path):
    store = await open_store(write_through=True)
    recs = [make_rec(i) for i in range(4)]
    assert await put(store, recs) == [True] * 4
    await store.close()
    # Reach the metadata through RocksDB itself, as another tool could: column family "blocks".
    db = Rdict(str(tmp_path / "disk" / "meta"), Options(raw_mode=True), column_families={"blocks": Options(raw_mode=True)})
    blocks = db.get_column_family("blocks")
    key = make_key(NS, recs[2].chain_hash)
    value = bytearray(blocks[key])
    value[16 + 30] ^= 0x20  # past the location prefix, inside the header map
    blocks[key] = bytes(value)
    blocks.close()
    db.close()

    again = await open_store(write_through=True)
    assert again.counters.checksum_failures == 1
    assert again.lookup(NS, [recs[2].chain_hash]).num_hits == 0 and not again.disk.contains(key)
    assert await get(again, NS, [r.chain_hash for r in recs]) == [(r.header, r.payload) for r in recs[:2]]
    assert await get(again, NS, [recs[3].chain_hash]) == [(recs[3].header, recs[3].payload)]
    assert (await again.check()).ok


# --- a slow disk ----------------------------------------------------------------------------------------


async def test_a_slow_disk_delays_the_commit_but_not_lookups_and_releases(open_store):
    store = await open_store(write_through=True)
    first = make_rec(0)
    assert await put(store, [first]) == [True]
    disk = store.disk
    real_put = disk.put_many
    writing, finish = threading.Event(), threading.Event()

    def slow_put(items):  # a struggling device: the real write, once the test lets it finish
        writing.set()
        assert finish.wait(PATIENCE_S), "the test never let the disk finish"
        real_put(items)

    disk.put_many = slow_put
    rec = make_rec(1)
    res = await store.reserve(NS, [rec.chain_hash], [len(rec.payload)])
    store.host.view(res.slots[0])[:] = rec.payload
    held = await store.acquire(NS, [first.chain_hash])
    commit = asyncio.create_task(store.commit(res.lease_id, [rec.header]))
    # The commit's disk write has started and cannot end before ``finish``: had it run on the
    # event loop, the loop would be stuck in it and this wait could never return.
    await wait_until_async(writing.is_set, what="the commit's disk write")
    assert store.lookup(NS, [first.chain_hash]).num_hits == 1
    assert store.release(held.lease_id)
    assert not commit.done()  # it waits for the disk
    finish.set()
    assert await commit == [True]
    del disk.put_many
    assert disk.contains(make_key(NS, rec.chain_hash))
    assert await get(store, NS, [rec.chain_hash]) == [(rec.header, rec.payload)]


# --- host tier exhaustion ---------------------------------------------------------------------------


async def test_an_exhausted_host_tier_answers_full_not_an_error(open_store):
    store = await open_store(host_bytes=4 * BLOCK, host_segment_bytes=4 * BLOCK)
    recs = [make_rec(i) for i in range(4)]
    assert await put(store, recs) == [True] * 4
    held = await store.acquire(NS, [r.chain_hash for r in recs])  # every slot pinned by a reader
    assert len(held.blocks) == 4
    new = make_rec(9)
    res = await store.reserve(NS, [new.chain_hash], [len(new.payload)])
    assert res.status == [PutStatus.FULL] and res.lease_id == 0 and res.slots == [None]
    assert await get(store, NS, [r.chain_hash for r in recs]) == [(r.header, r.payload) for r in recs]
    assert store.release(held.lease_id)
    assert await put(store, [new]) == [True], "room comes back once the readers are done"
    assert await get(store, NS, [new.chain_hash]) == [(new.header, new.payload)]
