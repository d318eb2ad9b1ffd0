"""The host tier survives a crash of its process: a store killed with SIGKILL leaves its segments in
/dev/shm, and the next store on the same directory adopts them, verifies every journaled block and
serves them again; torn or damaged ones are dropped and counted, deleted ones stay deleted."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kvtier.daemon.store.allocator import SlabAllocator
from kvtier.daemon.store.host_journal import DIRECTORY_NAME, FILE_MAGIC, SlotJournal, read_journal, replay
from kvtier.daemon.store.shm import SHM_DIR, map_segment, unique_name, unlink_segment
from kvtier.daemon.store.types import Slot, Tier
from tests.kvtier.daemon.store.storekit import BLOCK, NS, get, make_rec, put

ROOT = Path(__file__).resolve().parents[4]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("", "protocol", "connectors"))}
HOST = 4 << 20  # room for every block: nothing is evicted to disk
SIZES = [BLOCK, 2 * BLOCK, BLOCK, 3 * BLOCK]  # mixed classes: several slabs

_CHILD = textwrap.dedent("""
    import asyncio, sys
    from kvtier.daemon.store.config import StoreConfig
    from kvtier.daemon.store.store import TieredStore
    from tests.kvtier.daemon.store.storekit import NS, make_rec, put

    SIZES = [4096, 8192, 4096, 12288]

    async def main(path, prefix, host):
        store = TieredStore(StoreConfig(host_bytes=host, host_segment_bytes=host // 2, host_prefault=False,
                                        host_pin=False, host_name_prefix=prefix, disk_path=path,
                                        disk_bytes=1 << 26))
        await store.start()
        for i in range(24):
            assert await put(store, [make_rec(i, nbytes=SIZES[i % 4])]) == [True]
        await store.delete(NS, [make_rec(i).chain_hash for i in (3, 4)])
        seg = store.host.segments
        slot = store.index.get(NS + make_rec(7).chain_hash).host_slot
        print("SLOT", seg[slot.segment].name, seg[slot.segment].size, slot.offset, flush=True)
        print("DONE", flush=True)
        await asyncio.Event().wait()  # until killed

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
""")


def _run_and_kill(disk: Path, prefix: str) -> tuple[str, int, int]:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(disk), prefix, str(HOST)], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        lines = []
        for line in child.stdout:
            lines.append(line.split())
            if line.startswith("DONE"):
                break
        assert lines and lines[-1] == ["DONE"], child.stderr.read() if child.stderr else ""
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for f in (child.stdout, child.stderr):
            if f is not None:
                f.close()
    _, name, size, offset = lines[0]
    return name, int(size), int(offset)


async def test_a_killed_stores_host_blocks_are_adopted_verified_and_served(open_store, tmp_path):
    prefix = f"kvtier-adopt-{os.getpid()}"
    disk = tmp_path / "disk"
    name, size, offset = _run_and_kill(disk, prefix)
    assert (disk / DIRECTORY_NAME).is_file() and glob.glob(os.path.join(SHM_DIR, prefix + "-*.journal"))
    mm = map_segment(name, size)  # damage block 7's payload where it lies, as a stray write would
    mm[offset + 100] ^= 0xFF
    mm.close()

    store = await open_store(host_bytes=HOST, host_segment_bytes=HOST // 2, host_name_prefix=prefix)
    report = store.host_recovery
    assert report is not None
    assert (report.journaled, report.adopted, report.dropped) == (22, 21, 1)  # 24 - 2 deleted; 7 is bad
    assert store.counters.checksum_failures == 1
    kept = [i for i in range(24) if i not in (3, 4, 7)]
    for i in kept:
        r = make_rec(i, nbytes=SIZES[i % 4])
        info = store.info(NS, r.chain_hash)
        assert info is not None and info.tiers == [Tier.HOST] and info.header == r.header
        assert await get(store, NS, [r.chain_hash]) == [(r.header, r.payload)]
    for i in (3, 4, 7):
        assert store.info(NS, make_rec(i).chain_hash) is None
    store.host.allocator.check()
    assert (await store.check()).ok
    # New blocks go in beside the adopted ones; the adopted segments carry this process's names.
    news = [make_rec(100 + i, nbytes=SIZES[i % 4]) for i in range(6)]
    assert await put(store, news) == [True] * 6
    assert all(f"-{os.getpid()}-" in s.name for s in store.host.segments)
    await store.close()
    assert glob.glob(os.path.join(SHM_DIR, prefix + "-*")) == []  # a clean close leaves nothing
    assert not (disk / DIRECTORY_NAME).exists()


async def test_segments_of_another_layout_are_removed_not_adopted(open_store, tmp_path):
    prefix = f"kvtier-relayout-{os.getpid()}"
    _run_and_kill(tmp_path / "disk", prefix)
    store = await open_store(host_bytes=2 * HOST, host_segment_bytes=HOST, host_name_prefix=prefix)
    assert store.host_recovery is None and store.info(NS, make_rec(0).chain_hash) is None
    names = {s.name for s in store.host.segments}
    assert {os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, prefix + "-*"))} == \
        names | {store.host.journal.name}


def test_journal_replay_keeps_live_entries_and_drops_a_torn_tail():
    name = unique_name("kvtier-jtest")
    journal = SlotJournal(name)
    try:
        a, b, c = Slot(0, 0, 4096), Slot(0, 8192, 4096), Slot(1, 0, 100)
        journal.commit(a, 1, b"ha")
        journal.commit(b, 0, b"hb")
        journal.free(a)
        journal.commit(c, 2, b"hc")
        journal.flush()
        data = read_journal(name)
        assert data is not None and data.startswith(FILE_MAGIC)
        whole = replay(data)
        assert whole.torn == 0 and sorted(whole.live) == [(0, 8192), (1, 0)]
        assert whole.live[(1, 0)] == (c, 2, b"hc")
        cut = replay(data[:-3])  # killed inside the last write
        assert cut.torn == 1 and sorted(cut.live) == [(0, 8192)]
        assert replay(data[:-3] + b"\0\0\0").torn == 1  # a flipped digest byte stops it as well
    finally:
        journal.close(remove=True)
    assert read_journal(name) is None


def test_journal_compaction_rewrites_only_the_live_entries():
    name = unique_name("kvtier-jtest")
    journal = SlotJournal(name)
    try:
        header = b"h" * 1000
        for round_ in range(1500):  # ~1.5 MB of commits and frees, few live at a time
            slot = Slot(0, (round_ % 4) * 4096, 4096)
            journal.free(slot)
            journal.commit(slot, 0, header)
            journal.flush()
        data = read_journal(name)
        assert data is not None and len(data) < (1 << 20) + 4 * 1100
        assert sorted(replay(data).live) == [(0, o * 4096) for o in range(4)]
    finally:
        journal.close(remove=True)
    unlink_segment(name + ".tmp")


def test_allocator_adopts_slots_where_they_were_and_keeps_allocating():
    first = SlabAllocator(8 << 20, segment_bytes=4 << 20, slab_bytes=1 << 20)
    slots = [first.allocate(n) for n in [4096] * 10 + [12288] * 5 + [2 << 20]]
    assert all(s is not None for s in slots)
    for s in slots[1:10:3]:
        first.free(s)
    live = [s for i, s in enumerate(slots) if i not in (1, 4, 7)]
    again = SlabAllocator(8 << 20, segment_bytes=4 << 20, slab_bytes=1 << 20)
    overlapping = Slot(live[0].segment, live[0].offset, 4096)  # a second claim on the same bytes
    assert again.adopt([*live, overlapping, Slot(9, 0, 4096)]) == [True] * len(live) + [False, False]
    again.check()
    assert again.allocated_bytes == first.allocated_bytes and again.requested_bytes == first.requested_bytes
    more = [again.allocate(4096) for _ in range(100)]
    assert all(m is not None for m in more)
    taken = {(s.segment, s.offset) for s in live} | {(m.segment, m.offset) for m in more if m is not None}
    assert len(taken) == len(live) + 100
    for s in live:
        again.free(s)
    again.check()
