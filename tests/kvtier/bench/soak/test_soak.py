"""`kvtier bench soak`, reduced: a real daemon, real clients in worker processes, small tiers full.

The reduced soak asserts the invariants (no error of any kind, no wrong byte, no leaked lease,
descriptor, mapping or segment), not speed: the machine it runs on is shared.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from pathlib import Path


from kvtier.bench.soak import suite as soak
from kvtier.bench.soak.suite import Plan, Run
from kvtier.bench.soak.data import SIZES, Workload
from kvtier.bench.soak.proc import memory, shm_segments
from kvtier.bench.soak.rows import BOUND, violations
from kvtier.bench.soak.worker import OPS
from kvtier_protocol.header import split_record, verify_payload

MIB = 1 << 20


def _args(**kw: object) -> argparse.Namespace:
    # timeout_s: a call that errs is a violation, so the workers' calls get a timeout no busy
    # machine comes near
    base = dict(quick=True, repetitions=None, json=None, clients=8, seconds=4.0, processes=2, tcp_clients=1,
                host_mib=32, disk_mib=64, working_set=2.0, timeout_s=60.0, seed=3, work_dir=None,
                daemon_profile=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_workload_blocks_verify_and_a_wrong_byte_or_block_does_not() -> None:
    work = Workload(50, seed=7)
    rng = random.Random(0)
    assert Workload(50, seed=7).record(3, 2) == work.record(3, 2)  # any process derives the same
    for _ in range(20):
        p, j = work.pick(rng), rng.randrange(work.blocks)
        h, payload = split_record(work.record(p, j))
        verify_payload(h, payload)  # the header's checksum is the payload's
        assert h.chain_hash == work.key(p, j) and len(payload) == work.size(p, j) in SIZES
        assert work.payload_ok(p, j, payload)
        flipped = bytearray(payload)
        flipped[rng.randrange(len(flipped))] ^= 0x01
        assert not work.payload_ok(p, j, flipped)
    _, other = split_record(work.record(4, 1))
    assert not work.payload_ok(4, 0, other)  # another block, even one of the same prefix


def test_reduced_soak_has_no_errors_and_leaks_nothing() -> None:
    result = soak.run(_args())
    rows = {(r.case, r.metric): r for r in result.rows}
    # Every invariant holds, the RSS bound too: it names the disk tier's buffers and the clients'
    # in-flight payloads, which at these tiny tiers are more than 10 % of them.
    assert violations(result) == []
    for op in OPS:
        assert rows[(op, "operations")].kvtier > 0, f"no {op} ran"
    assert rows[("load", "blocks hit")].kvtier > 0 and rows[("load_into", "blocks hit")].kvtier > 0
    # At full capacity throughout: both tiers evicted during the measured window.
    assert rows[("host tier evictions", "blocks evicted")].kvtier > 0
    assert rows[("disk tier evictions", "blocks evicted")].kvtier > 0
    assert rows[("save", "blocks stored")].kvtier > 0
    for r in result.rows:
        if r.baseline_name.startswith(BOUND) and "shared memory" in r.case:
            assert r.kvtier <= r.baseline  # the daemon maps no more of the host tier than it has


def test_disk_tier_ram_follows_the_host_tier() -> None:
    """A write-back stream through a 32 MiB host tier into RocksDB must not grow the daemon's private
    memory by more than that tier: RocksDB holds every value in a memtable until a flush moves it
    to a blob file, and memtables of a fixed 64 MiB (up to 4) made the disk tier cost ~90 MiB of
    RAM beside a 32 MiB host tier."""
    plan = Plan.from_args(_args(host_mib=32, disk_mib=160))
    work_dir = Path(tempfile.mkdtemp(prefix="kvtier-soak-ram-"))
    run = Run(plan, work_dir)
    try:
        run.start()
        run.prefill()  # ~200 MiB saved: every block is demoted through the memtables
        mem = memory(run.pid)
        growth = mem["RssAnon"] + mem["RssFile"] - run.fig.idle_private
    finally:
        if run.daemon is not None:
            run.daemon.stop()
        shutil.rmtree(work_dir, ignore_errors=True)
    assert shm_segments(run.prefix) == []
    assert growth <= plan.host_bytes, f"private memory grew {growth / MIB:.0f} MiB beside a " \
                                      f"{plan.host_bytes / MIB:.0f} MiB host tier"
