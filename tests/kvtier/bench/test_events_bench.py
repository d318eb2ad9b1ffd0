"""`kvtier bench events`: a tiny run through the CLI (the daemon's EventHub, a real ZMQ PUB socket, a
subscriber process decoding every batch) writes the report.py JSON form; the workload is what it
says (no speed asserts)."""

from __future__ import annotations

import gc
import json
import math
from dataclasses import fields
from pathlib import Path

import pytest

from kvtier.bench.events import Workload
from kvtier.bench.report import Row
from kvtier.cli import main
from kvtier.daemon.server.event_translate import EventTranslator
from kvtier.daemon.store.stats import EventKind
from kvtier_protocol.events import BlockRemoved, BlockStored, decode_batch, decode_event


def test_quick_events_bench_writes_both_forms_rows_per_geometry(tmp_path: Path) -> None:
    out = tmp_path / "events.json"
    threshold = gc.get_threshold()
    assert main(["bench", "events", "--quick", "--repetitions", "1", "--json", str(out),
                 "--geometry", "16/16,64/16", "--events", "256", "--batch", "64", "--chain", "8"]) == 0
    # the run sets the daemon's collector policy (raised threshold, workload frozen) and undoes it
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "events"
    names = {f.name for f in fields(Row)}
    rates, stuck = doc["rows"][:-2], doc["rows"][-2:]
    assert [(r["case"], r["metric"], r["baseline_name"]) for r in rates] == [
        (f"{case}, 64 per publish{form}", metric, base)
        for case in ("16-token blocks (1 hashes)", "64-token blocks (4 hashes)")
        for form in ("", ", packed token ids (SPEC 9.8)")
        for metric, base in (("published", "raw pyzmq PUB, same bytes"),
                             ("received + decoded", "raw pyzmq PUB/SUB, same bytes"),
                             ("decode only", "msgpack.unpackb, same bytes"))]
    for row in rates:
        assert set(row) == names and row["unit"] == "events/s"
        assert math.isfinite(row["kvtier"]) and row["kvtier"] > 0 and row["baseline"] > 0
        assert row["ratio"] == pytest.approx(row["kvtier"] / row["baseline"])
    # publish beside a subscriber that never reads (the figure test_events' stuck-subscriber test
    # leaves to the bench): lower is better, ratio = nobody subscribed / stuck.
    assert [(r["metric"], r["unit"], r["baseline_name"]) for r in stuck] == [
        (m, "ms", "same calls, nobody subscribed") for m in ("p99 call", "slowest call")]
    for row in stuck:
        assert "never reads" in row["case"] and row["kvtier"] > 0 and row["baseline"] > 0
        assert row["ratio"] == pytest.approx(row["baseline"] / row["kvtier"])


def test_workload_alternates_stores_and_their_removals() -> None:
    work = Workload.make(64, 16, total=200, batch=50, chain=8)
    assert work.units == 4 and work.events == 200 == sum(map(len, work.publishes))
    assert len(work.publishes) == len(work.notes) == len(work.batches) == 4
    for noted, stored, removed in zip(work.notes[::2], work.publishes[::2], work.publishes[1::2]):
        assert [e.kind for e in stored] == [EventKind.STORED] * 50 and [e.kind for e in removed] == [EventKind.REMOVED] * 50
        assert [b.chain_hash for b in noted] == [e.chain_hash for e in stored] == [e.chain_hash for e in removed]
        assert all(len(b.tokens) == 64 and len(b.unit_hashes) == 4 for b in noted)
    first = work.publishes[0]
    assert first[0].parent_hash is None and first[8].parent_hash is None  # a chain starts every 8 blocks
    assert first[1].parent_hash == first[0].chain_hash
    # Translated as the hub does it: full BlockStored events with tokens (merged per chain), then
    # removals carrying the same unit hashes.
    translator = EventTranslator()
    translator.note_blocks(work.ns.ns_id, work.notes[0])
    stored_wire = [decode_event(w) for w in translator.translate_wire(first, {work.ns.ns_id: work.ns})]
    assert all(isinstance(e, BlockStored) and e.medium == "CPU" for e in stored_wire)
    assert sum(len(e.block_hashes) for e in stored_wire) == 50 * 4
    assert sum(len(e.token_ids) for e in stored_wire) == 50 * 64
    removed_wire = [decode_event(w) for w in translator.translate_wire(work.publishes[1], {work.ns.ns_id: work.ns})]
    assert all(isinstance(e, BlockRemoved) for e in removed_wire)
    assert sum(len(e.block_hashes) for e in removed_wire) == 50 * 4
    assert all(decode_batch(b).events for b in work.batches)  # the raw baseline sends real batches
    # the packed form's baseline: the same events, token ids as bins (SPEC 9.8)
    assert len(work.packed_batches) == len(work.batches)
    for plain, packed in zip(work.batches, work.packed_batches):
        a, b = decode_batch(plain).events, decode_batch(packed, packed=True).events
        assert [(e.block_hashes, list(getattr(e, "token_ids", ()))) for e in a] == \
            [(e.block_hashes, list(getattr(e, "token_ids", ()))) for e in b]
