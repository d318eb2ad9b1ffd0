"""Persistence and other processes: reopen, the flush of memory blocks at a clean close, SIGKILL after a
write-through ack, a client mapping the host tier."""

from __future__ import annotations

import glob
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kvtier.daemon.store.shm import SHM_DIR
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.store.storekit import BLOCK, NS, Clock, get, make_rec, put

ROOT = Path(__file__).resolve().parents[4]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("", "protocol", "connectors"))}


async def test_every_disk_block_is_found_with_its_header_after_reopen(open_store, tmp_path):
    store = await open_store(host_bytes=4 * BLOCK, flush_on_close=False)
    recs = [make_rec(i) for i in range(12)]
    for r in recs:
        await put(store, [r])
    on_disk = [r for r in recs if Tier.DISK in store.lookup(NS, [r.chain_hash]).tiers]
    assert len(on_disk) == 8
    await store.close()  # without the flush: the 4 host-only blocks are gone

    again = await open_store(host_bytes=4 * BLOCK)
    assert again.gauges().tiers[Tier.DISK].blocks == 8
    for r in on_disk:
        info = again.info(NS, r.chain_hash)
        assert info is not None and info.header == r.header and info.tiers == [Tier.DISK]
    assert await get(again, NS, [r.chain_hash for r in on_disk[:4]]) == [(r.header, r.payload) for r in on_disk[:4]]
    assert (await again.check()).ok


async def test_clean_close_writes_host_only_blocks_to_disk(open_store):
    store = await open_store()  # write-back, nothing evicted: all host-only
    recs = [make_rec(i) for i in range(6)]
    assert await put(store, recs) == [True] * 6
    assert store.disk.num_records == 0 and store.lookup(NS, [r.chain_hash for r in recs]).tiers == [Tier.HOST] * 6
    await store.close()
    assert [e.tier for e in store.take_events()][-6:] == [Tier.DISK] * 6  # announced as stored on disk

    again = await open_store()
    for r in recs:
        info = again.info(NS, r.chain_hash)
        assert info is not None and info.header == r.header and info.tiers == [Tier.DISK]
        assert again.disk.get(make_key(NS, r.chain_hash)) == r.header + r.payload
    assert await get(again, NS, [r.chain_hash for r in recs]) == [(r.header, r.payload) for r in recs]
    assert (await again.check()).ok


async def test_close_writes_down_only_what_the_filter_admits_and_the_disk_holds(open_store):
    clock = Clock()
    recs = [make_rec(i) for i in range(5)]
    record = max(len(r.header) for r in recs) + BLOCK
    store = await open_store(host_bytes=8 * BLOCK, disk_bytes=3 * record, disk_admit_hits=2, now=clock)
    for r in recs:
        clock.t += 1
        await put(store, [r])
    for r in (recs[3], recs[0], recs[1], recs[2]):  # 4 is read never: the filter refuses it
        clock.t += 1
        await get(store, NS, [r.chain_hash])
    await store.close()  # written least recent first: 3, 0, 1, 2; the disk keeps the last three
    assert store.counters.admission_rejects == 1 and store.counters.tiers[Tier.DISK].evictions == 1

    again = await open_store(host_bytes=8 * BLOCK, disk_bytes=3 * record)
    assert [again.info(NS, r.chain_hash) is not None for r in recs] == [True, True, True, False, False]
    assert (await again.check()).ok


async def test_a_failing_disk_at_close_still_closes_every_tier(open_store):
    store = await open_store()
    await put(store, [make_rec(0)])
    store.disk.close()  # the flush's write fails
    await store.close()
    assert store.host is None and store.disk is None and store.counters.storage_errors == 1


async def test_reopen_drops_records_whose_header_is_damaged(open_store, tmp_path):
    store = await open_store(write_through=True)
    good, bad = make_rec(0), make_rec(1)
    await put(store, [good, bad])
    damaged = bytearray(bad.header)
    damaged[-2] ^= 0x40
    store.disk.put_many([(make_key(NS, bad.chain_hash), bytes(damaged), bad.payload)])
    await store.close()

    again = await open_store()
    assert again.info(NS, good.chain_hash) is not None and again.info(NS, bad.chain_hash) is None
    assert again.counters.checksum_failures == 1
    assert not again.disk.contains(make_key(NS, bad.chain_hash))


_CHILD = textwrap.dedent("""
    import asyncio, sys
    from kvtier.daemon.store.config import StoreConfig
    from kvtier.daemon.store.store import TieredStore
    from tests.kvtier.daemon.store.storekit import make_rec, put

    async def main(path, prefix):
        store = TieredStore(StoreConfig(host_bytes=1 << 20, host_prefault=False, host_pin=False,
                                        host_name_prefix=prefix, disk_path=path, disk_bytes=1 << 26,
                                        write_through=True))
        await store.start()
        i = 0
        while True:  # until killed
            if await put(store, [make_rec(i)]) == [True]:
                print("ACK", i, flush=True)
            i += 1

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


async def test_write_through_acks_survive_sigkill(open_store, tmp_path):
    prefix = f"kvtier-kill-{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "disk"), prefix], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    acked: list[int] = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            acked.append(int(line.split()[1]))
            if len(acked) == 40:
                break
        child.send_signal(signal.SIGKILL)  # mid-way through later puts
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
        for path in glob.glob(os.path.join(SHM_DIR, prefix + "-*")):
            os.unlink(path)  # the killed child could not unlink its host segments
    assert len(acked) == 40, "the child stopped before acknowledging 40 commits"

    store = await open_store()
    recs = [make_rec(i) for i in acked]
    for r in recs:
        info = store.info(NS, r.chain_hash)
        assert info is not None and info.header == r.header
    assert await get(store, NS, [r.chain_hash for r in recs[:8]]) == [(r.header, r.payload) for r in recs[:8]]
    assert (await store.check()).ok


_READER = textwrap.dedent("""
    import hashlib, sys
    from kvtier.daemon.store.shm import map_segment
    name, size, offset, length = sys.argv[1], *map(int, sys.argv[2:])
    mm = map_segment(name, size, writable=False)
    print(hashlib.sha256(mm[offset:offset + length]).hexdigest())
    mm.close()
""")


async def test_another_process_reads_a_committed_block_through_its_slot(open_store):
    # Mixed block sizes: room for more than one slab (the allocator's first slab of a class is 1 MiB).
    store = await open_store(host_bytes=4 << 20, host_segment_bytes=4 << 20)
    rec = make_rec(3, nbytes=3 * BLOCK)
    await put(store, [make_rec(0), rec])
    acq = await store.acquire(NS, [rec.chain_hash])
    slot = acq.blocks[0].slot
    seg = store.host.segments[slot.segment]
    out = subprocess.run([sys.executable, "-c", _READER, seg.name, str(seg.size), str(slot.offset), str(slot.length)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, check=True, timeout=60)
    store.release(acq.lease_id)
    assert out.stdout.strip() == hashlib.sha256(rec.payload).hexdigest()
    assert store.disk.contains(make_key(NS, rec.chain_hash)) is False  # it came from memory, not disk
