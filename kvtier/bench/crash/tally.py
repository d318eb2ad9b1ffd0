"""What a `kvtier bench crash` run counts, and the rows it reports."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvtier.bench.report import Row

PHASES = ("reserve", "copy", "commit", "place", "demotion", "flush", "compaction")
HOST_PHASE = "host"  # the host-tier phase: its own kill count (--host-kills), not among --phases


@dataclass(slots=True)
class Tally:
    """What one run found."""

    kills: int = 0
    survived: int = 0
    restarts: int = 0
    started: int = 0
    consistent: int = 0
    clean_stops: int = 0
    aimed: Counter[str] = field(default_factory=Counter)
    hit: Counter[str] = field(default_factory=Counter)
    landed: Counter[str] = field(default_factory=Counter)
    lost: set[tuple[int, int]] = field(default_factory=set)
    bad: set[tuple[int, int]] = field(default_factory=set)
    served: int = 0
    anomalies: list[str] = field(default_factory=list)
    final_acked: int = 0
    final_intact: int = 0
    cli_check_rc: int | None = None
    host_kills: int = 0  # kills of the host-tier phase (write-back, blocks only in host memory)
    host_committed: int = 0  # blocks a commit had acknowledged into host memory before those kills
    host_recovered: int = 0  # of those, served again (byte-identical) after the restart


def hit(aimed: str, step: str) -> bool:
    """Whether a kill aimed at ``aimed`` landed inside it (not just after it, nor elsewhere)."""
    if aimed == "demotion":
        return step == "reserve"
    if aimed in ("flush", "compaction", HOST_PHASE):
        return step.startswith(aimed)
    return step == aimed



def rows(t: Tally) -> list[Row]:
    """The suite's rows: each a count next to the count it should equal (ratio 1.0 = all good)."""
    def row(case: str, unit: str, value: int, base_name: str, base: int) -> Row:
        return Row(case, "count", unit, float(value), base_name, float(base), value / base if base else 1.0)

    out = [
        row("kills survived", "kills", t.survived, "kills delivered", t.kills),
        row("blocks recovered at the end", "blocks", t.final_intact, "blocks acknowledged durable", t.final_acked),
        row("acknowledged blocks never lost", "blocks", t.final_acked - len(t.lost), "blocks acknowledged durable",
            t.final_acked),
        row("restarts consistent (check)", "restarts", t.consistent, "restarts", t.started),
        row("served blocks intact", "blocks", t.served - len(t.bad), "blocks served", t.served),
        row("runs without anomaly", "runs", int(not t.anomalies), "runs", 1),
    ]
    if t.host_kills:
        out.append(row("host tier: committed blocks served again after kill -9", "blocks", t.host_recovered,
                       "blocks committed into host memory (write-back)", t.host_committed))
    for phase in (*PHASES, HOST_PHASE):
        if t.aimed[phase]:
            out.append(row(f"kills landed in {phase}", "kills", t.hit[phase], "kills aimed", t.aimed[phase]))
    return out
