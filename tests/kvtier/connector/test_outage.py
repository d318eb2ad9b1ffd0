"""OutageLog: an outage is logged when it starts and when it ends, other failures each time."""

from __future__ import annotations

import logging

from kvtier_protocol.errors import LimitExceeded, Unavailable

from kvtier.connector.outage import OutageLog

log = logging.getLogger("kvtier.test.outage")


def test_an_outage_logs_once_each_way_and_other_errors_every_time(caplog) -> None:
    outage = OutageLog(log, "recomputing", prefix="kvtier connector")
    with caplog.at_level(logging.INFO, logger=log.name):
        reasons = [outage.failed("load", Unavailable("socket gone")) for _ in range(5)]
        outage.ok()
        outage.ok()
        other = outage.failed("save", LimitExceeded("too big"))
        outage.failed("save", LimitExceeded("too big"))
    lines = [r.getMessage() for r in caplog.records]
    assert reasons == ["daemon unavailable (socket gone)"] * 5
    assert other == "save failed (limit_exceeded: too big)"
    assert lines == ["kvtier daemon unavailable during load (socket gone); recomputing until it is back",
                     "kvtier daemon available again",
                     "kvtier connector: save failed (limit_exceeded: too big); recomputing",
                     "kvtier connector: save failed (limit_exceeded: too big); recomputing"]
