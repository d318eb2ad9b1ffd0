"""Client options: validation at construction, the token kept out of reprs."""

from __future__ import annotations

import math
import os

import pytest

from kvtier.client import ClientOptions
from kvtier_protocol.errors import InvalidRequest


def test_defaults() -> None:
    o = ClientOptions()
    assert (o.timeout_s, o.retries, o.token, o.tenant) == (5.0, 2, None, None)
    assert "hunter2" not in repr(ClientOptions(token="hunter2"))


@pytest.mark.parametrize("kwargs", [
    {"timeout_s": 0}, {"timeout_s": -1}, {"timeout_s": math.inf}, {"timeout_s": "5"},
    {"connect_timeout_s": math.nan}, {"retries": -1}, {"retries": 1.5}, {"retries": True},
    {"holddown_s": -0.1}, {"lease_ms": 0}, {"client_name": ""}, {"token": 5}, {"pipeline_bytes": -1},
    {"tenant": "t" * 1025}, {"write_behind": 1}, {"write_behind": "yes"}, {"grant_bytes": -1}, {"grant_bytes": 1.5},
    {"copy_threads": 0}, {"copy_threads": 17}, {"copy_threads": 2.0}, {"copy_threads": True},
])
def test_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidRequest):
        ClientOptions(**kwargs)


def test_copy_threads_default_to_the_environment_or_this_process_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_COPY_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert ClientOptions().resolved_copy_threads == max(1, min(4, cpus))
    assert ClientOptions(copy_threads=3).resolved_copy_threads == 3
    monkeypatch.setenv("KVTIER_COPY_THREADS", "5")
    assert ClientOptions().resolved_copy_threads == 5
    assert ClientOptions(copy_threads=2).resolved_copy_threads == 2  # an explicit option wins
    monkeypatch.setenv("KVTIER_COPY_THREADS", "many")
    with pytest.raises(InvalidRequest, match="KVTIER_COPY_THREADS"):
        ClientOptions()  # at construction, not at the first save
    assert ClientOptions(copy_threads=1).resolved_copy_threads == 1
