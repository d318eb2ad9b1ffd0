"""`kvtier bench abuse`: a short run through the CLI (a real daemon on its defaults, a spawned
attacker, a well-behaved unix-socket client) writes the report.py JSON form with its three rows;
the attack frames are what they claim (no speed asserts)."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

from kvtier.bench.abuse import ANNOUNCED, _announcement
from kvtier.bench.report import Row
from kvtier.cli import main
from kvtier_protocol import frames as fr


def test_quick_abuse_bench_writes_latency_and_memory_rows(tmp_path: Path) -> None:
    out = tmp_path / "abuse.json"
    assert main(["bench", "abuse", "--quick", "--repetitions", "1", "--calls", "30", "--seconds", "0.5",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "abuse"
    names = {f.name for f in fields(Row)}
    assert [(r["metric"], r["unit"], r["baseline_name"]) for r in doc["rows"]] == [
        ("save+load p50", "ms", "same client, no attack"), ("save+load p99", "ms", "same client, no attack"),
        ("daemon private RSS growth", "MiB", "dataplane.max_buffer_bytes (bound)")]
    for row in doc["rows"]:
        assert set(row) == names and math.isfinite(row["kvtier"]) and row["kvtier"] >= 0 and row["baseline"] > 0
    growth, bound = doc["rows"][2]["kvtier"], doc["rows"][2]["baseline"]
    assert bound == 1024 and growth < bound, "the daemon's memory stayed within its configured bound"


def test_the_memory_attack_announces_a_payload_it_never_sends() -> None:
    frame = _announcement()
    header_len, payload_len, has_payload = fr.parse_preamble(frame[:fr.PREAMBLE_LEN], fr.Limits())
    assert has_payload and payload_len == ANNOUNCED == 256 << 20
    assert len(frame) == fr.PREAMBLE_LEN + header_len  # the header, and not one payload byte
    assert fr.decode_header(frame[fr.PREAMBLE_LEN:])["op"] == "put"
