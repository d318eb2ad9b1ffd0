"""`kvtier bench crash` at a reduced count: a real daemon SIGKILLed under a durable writer, restarted each time.

The invariants, not the speed: every kill survived (the daemon starts, `check` is consistent), every
block acknowledged as durable is served intact at the end, no served block differs from what was
written, and the writer met no anomaly. Compaction is left to the full run (catching RocksDB's
compaction thread can take several lives); the kills here aim at reserve, copy, commit, the place
of a save into granted slots, a write-back demotion and the flush of a SIGTERM'd close.
"""

from __future__ import annotations

import argparse
import json

from kvtier.bench.crash import suite as crash
from kvtier.bench.report import emit


def _args(tmp_path, **over: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    crash.add_arguments(parser)
    args = parser.parse_args([])
    args.quick, args.repetitions, args.json = True, None, None
    args.work_dir = str(tmp_path)
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_six_kills_lose_no_acknowledged_block_and_serve_no_bad_one(tmp_path, capsys):
    args = _args(tmp_path, kills=6, phases="reserve,copy,commit,place,demotion,flush", seed=7, host_kills=0)
    result = crash.run(args)
    rows = {r.case: r for r in result.rows}

    assert rows["kills survived"].baseline == 6 and rows["kills survived"].kvtier == 6
    acked = rows["blocks recovered at the end"].baseline
    assert acked > 0 and rows["blocks recovered at the end"].kvtier == acked
    assert rows["acknowledged blocks never lost"].kvtier == acked
    checks = rows["restarts consistent (check)"]
    assert checks.baseline >= 7 and checks.kvtier == checks.baseline  # after each kill and at the end
    served = rows["served blocks intact"]
    assert served.baseline > 0 and served.kvtier == served.baseline
    assert rows["runs without anomaly"].kvtier == 1, capsys.readouterr().err[-3000:]
    assert {f"kills landed in {p}" for p in ("reserve", "copy", "commit", "place", "demotion", "flush")} <= set(rows)

    out = tmp_path / "crash.json"
    emit([result], json_path=str(out))
    doc = json.loads(out.read_text())
    assert doc["suite"] == "crash" and {r["case"] for r in doc["rows"]} == set(rows)


def test_five_kills_under_write_back_keep_the_host_tier(tmp_path, capsys):
    """The host-tier phase as CI runs it (``--quick``: 5 kills): write-back, blocks only in host
    memory, SIGKILL; each restart adopts the dead daemon's segments and serves >= 99 % of the
    committed blocks again, byte-identical, and never a wrong one."""
    args = _args(tmp_path, kills=0, seed=5)  # --quick's host-tier kills: 5
    result = crash.run(args)
    rows = {r.case: r for r in result.rows}
    host = rows["host tier: committed blocks served again after kill -9"]
    err = capsys.readouterr().err[-3000:]
    assert host.baseline > 0 and host.kvtier >= 0.99 * host.baseline, err
    assert rows["kills survived"].baseline == 5 and rows["kills survived"].kvtier == 5, err
    served = rows["served blocks intact"]
    assert served.baseline > 0 and served.kvtier == served.baseline, err
    assert rows["runs without anomaly"].kvtier == 1, err
    assert rows["kills landed in host"].kvtier == 5
