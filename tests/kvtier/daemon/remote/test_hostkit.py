"""The many-hosts kit itself: where namespaces cannot be made a test skips with the reason, unless
CI demands them (KVTIER_REQUIRE_NETNS=1), where it fails instead."""

from __future__ import annotations

import pytest

from tests.manyhosts.netns import REQUIRE_ENV, skip_or_fail
from tests.manyhosts.rediscluster import parse_nodes


def test_unavailable_namespaces_skip_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="not root"):
        skip_or_fail("not root")


def test_unavailable_namespaces_fail_when_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="KVTIER_REQUIRE_NETNS=1 .* no ip"):
        skip_or_fail("no ip")


def test_cluster_nodes_lines_parse() -> None:
    text = ("a1 10.213.7.1:7001@17001 myself,master - 0 0 1 connected 0-5460\n"
            "b2 10.213.7.2:7002@17002 slave a1 0 1 1 connected\n"
            "c3 10.213.7.3:7001@17001 master,fail - 0 1 3 disconnected 5461 5462-10922 [5463->-x]\n")
    a, b, c = parse_nodes(text)
    assert a.is_master and a.slots == ((0, 5460),) and a.serves(5460) and not a.serves(5461)
    assert not b.is_master and b.master == "a1" and b.address == "10.213.7.2:7002"
    assert c.failed and c.slots == ((5461, 5461), (5462, 10922))
