"""The blocking client against the toy peer (peer.py): every op, both paths, and failure modes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.client import NO_HITS, Client, ConnectionLost, LookupResult, TimedOut
from kvtier.client.errors import Unreachable
from kvtier_protocol.errors import InvalidKey, InvalidRequest, Truncated, Unauthorized, Unavailable
from kvtier_protocol.frames import Limits
from kvtier_protocol.header import decode_header
from tests.kvtier.client.clientkit import (NS_ID, OTHER_NS_ID, eventually, key, make_blocks, make_record,
                                          short_timeout)
from tests.kvtier.client.peer import Peer
from tests.kvtier.waitkit import ManualClock

MiB = 1 << 20


def addresses(peer: Peer) -> dict[str, str]:
    return {"unix": f"unix:{peer.unix_path}", "tcp": f"127.0.0.1:{peer.tcp_port}"}


@pytest.mark.parametrize("path", ["unix", "tcp"])
def test_save_load_byte_identical(peer: Peer, path: str) -> None:
    blocks = make_blocks(2, 2 * MiB) + make_blocks(1, 8 * MiB, tag=b"big")
    keys = [k for k, _ in blocks]
    with Client.connect(addresses(peer)[path]) as kv:
        assert (kv.session.shm is not None) == (path == "unix")
        assert kv.save(NS_ID, blocks) == ["stored"] * 3
        assert kv.lookup(NS_ID, keys) == LookupResult(3, ("host",) * 3)
        assert kv.load(NS_ID, keys) == [r for _, r in blocks]
        assert kv.save(NS_ID, blocks[:1]) == ["exists"]
    used = {"unix": ("reserve", "commit", "acquire", "release"), "tcp": ("put", "get")}[path]
    unused = {"unix": ("put", "get"), "tcp": ("reserve", "commit", "acquire")}[path]
    assert all(peer.ops[op] for op in used) and not any(peer.ops[op] for op in unused)
    assert eventually(lambda: not peer.leases), "every reservation was committed and every pin released"


@pytest.mark.parametrize("threads", [1, 3])
def test_saves_and_loads_copy_on_the_configured_threads(peer: Peer, threads: int) -> None:
    # 12 MiB batches: above kvtier.client.memcopy.PARALLEL_MIN_BYTES, so three threads share each copy.
    blocks = make_blocks(3, 4 * MiB, tag=b"threads")
    keys = [k for k, _ in blocks]
    with Client.connect(addresses(peer)["unix"], copy_threads=threads) as kv:
        assert kv.session.shm.copy_threads == threads
        assert kv.save(NS_ID, blocks) == ["stored"] * 3
        assert kv.load(NS_ID, keys) == [r for _, r in blocks]
        payloads = [memoryview(r)[len(r) - 4 * MiB:] for _, r in blocks]
        into = [bytearray(4 * MiB) for _ in blocks]
        assert len(kv.load_into(NS_ID, keys, into)) == 3
        assert [bytes(b) for b in into] == [bytes(p) for p in payloads]


@pytest.mark.parametrize("path", ["unix", "tcp"])
def test_prefix_semantics_and_batching(make_peer: Callable[..., Peer], path: str) -> None:
    peer = make_peer(limits=Limits(max_batch=4))
    blocks = make_blocks(10, 4096)
    keys = [k for k, _ in blocks] + [key(99)]
    with Client(addresses(peer)[path]) as kv:
        assert kv.lookup(NS_ID, keys) is NO_HITS
        assert kv.save(NS_ID, blocks[:3] + blocks[4:]) == ["stored"] * 9
        assert kv.lookup(NS_ID, keys) == LookupResult(3, ("host",) * 3)
        assert kv.load(NS_ID, keys) == [r for _, r in blocks[:3]]
        assert kv.save(NS_ID, blocks) == ["exists"] * 3 + ["stored"] + ["exists"] * 6
        assert kv.lookup(NS_ID, keys).num_hits == 10
        assert kv.load(NS_ID, keys) == [r for _, r in blocks]
        assert kv.lookup(OTHER_NS_ID, keys) is NO_HITS
    assert peer.ops["lookup"] == 1 + 1 + 3 + 1  # batches of 4, each lookup stops at its first miss
    assert eventually(lambda: not peer.leases)


def test_full_is_not_an_error(make_peer: Callable[..., Peer]) -> None:
    peer = make_peer(segment_bytes=MiB)
    blocks = make_blocks(3, MiB // 2)
    for path in ("unix", "tcp"):
        with Client(addresses(peer)[path]) as kv:
            assert kv.save(NS_ID, blocks) == (["stored", "stored", "full"] if path == "unix"
                                              else ["exists", "exists", "full"])
    assert eventually(lambda: not peer.leases)


def test_corrupt_block_is_a_miss_and_the_pin_is_released(peer: Peer) -> None:
    blocks = make_blocks(3, 4096)
    keys = [k for k, _ in blocks]
    with Client(peer.unix_path) as kv:
        kv.save(NS_ID, blocks)
        _, slot = peer.blocks[(NS_ID, keys[1])]
        peer.mm[slot[1]] ^= 0xFF  # flip one payload byte in shared memory
        assert kv.load(NS_ID, keys) == [blocks[0][1]]
        assert eventually(lambda: peer.ops["release"] == 1 and not peer.leases)
    with Client(f"127.0.0.1:{peer.tcp_port}") as kv:
        assert kv.load(NS_ID, keys) == [blocks[0][1]]


def test_malformed_saves_fail_before_sending(peer: Peer) -> None:
    (k0, r0), (k1, r1) = make_blocks(2, 4096)
    with Client(peer.unix_path) as kv:
        with pytest.raises(InvalidRequest):
            kv.save(NS_ID, [(k1, r0)])  # the record names another key
        with pytest.raises(InvalidRequest):
            kv.save(OTHER_NS_ID, [(k0, r0)])
        with pytest.raises(InvalidKey):
            kv.save(NS_ID[:8], [(k0, r0)])
        with pytest.raises(InvalidKey):
            kv.lookup(NS_ID, [b"short"])
        with pytest.raises(InvalidRequest):
            kv.save(NS_ID, [(k0, r0)], priority=200)
        with pytest.raises(InvalidRequest):
            kv.save(NS_ID, [(k0, r0)], tokens=[[1, 2], [3]])  # one entry per block
        with pytest.raises(InvalidRequest):
            kv.save(NS_ID, [(k0, r0)], tokens=[[1, 2]], unit_hashes=[[k1]])  # last unit != key
        with pytest.raises(Truncated):
            kv.save(NS_ID, [(k0, r0[:-1])])
    assert peer.ops["hello"] == 0, "nothing reached the daemon"


@pytest.mark.parametrize("path", ["unix", "tcp"])
def test_token_info_reaches_commit_and_put(peer: Peer, path: str) -> None:
    blocks = make_blocks(2, 4096)
    tokens = [list(range(16)), list(range(16, 32))]
    units = [[key(50), blocks[0][0]], None]
    with Client(addresses(peer)[path]) as kv:
        kv.save(NS_ID, blocks, tokens=tokens, unit_hashes=units, priority=5)
    req = peer.last["commit" if path == "unix" else "put"]
    assert [list(t) for t in req.tokens] == tokens  # decoded as arrays of ids
    assert req.unit_hashes == (tuple(units[0]), None)
    assert (peer.last["reserve"] if path == "unix" else req).priority == 5


def test_delete_clear_stats_ping(peer: Peer) -> None:
    blocks = make_blocks(4, 4096)
    keys = [k for k, _ in blocks]
    with Client(peer.unix_path) as kv:
        kv.save(NS_ID, blocks)
        kv.save(OTHER_NS_ID, [(keys[0], make_record(OTHER_NS_ID, keys[0], 4096))])
        assert kv.stats()["blocks"] == 5
        assert 0 < kv.ping() < 1
        assert kv.delete(NS_ID, keys[2:] + [key(77)]) == 2
        assert kv.lookup(NS_ID, keys).num_hits == 2
        assert kv.clear(NS_ID) == 2
        assert kv.lookup(NS_ID, keys) is NO_HITS
        assert kv.lookup(OTHER_NS_ID, keys[:1]).num_hits == 1


def test_stalled_daemon_degrades_then_fails_fast_within_the_holddown(peer: Peer) -> None:
    blocks = make_blocks(2, 4096)
    keys = [k for k, _ in blocks]
    clock = ManualClock()
    with Client(peer.unix_path, timeout_s=30.0, holddown_s=5.0, clock=clock) as kv:
        kv.save(NS_ID, blocks)
        peer.stalled.set()  # the peer reads requests and never answers them
        with short_timeout(kv):
            assert kv.lookup(NS_ID, keys) is NO_HITS  # silence costs the call's timeout, then a miss
        seen = sum(peer.ops.values())
        assert kv.load(NS_ID, keys) == []  # within the hold-down: degraded without asking...
        with pytest.raises(Unavailable, match="moments ago"):
            kv.lookup(NS_ID, keys, degrade=False)
        assert sum(peer.ops.values()) == seen, "...so no request reached the stuck daemon: no wait on it"
        clock.advance(5.0)  # the hold-down is over: the next call asks (and waits) again
        with short_timeout(kv), pytest.raises(TimedOut):
            kv.load(NS_ID, keys, degrade=False)
        peer.stalled.clear()
        clock.advance(5.0)
        assert kv.load(NS_ID, keys) == [r for _, r in blocks]  # reconnected by itself
    assert peer.ops["hello"] >= 2


def test_dead_daemon_degrades_fast(peer: Peer) -> None:
    kv = Client(peer.unix_path, timeout_s=30.0, holddown_s=0)
    peer.stop()
    peer.stop = lambda: None  # type: ignore[method-assign]  # the fixture must not stop it twice
    # Refused connections fail the call at once (a timeout of 30 s is never waited for): the
    # errors say the daemon is unreachable, not that it was silent.
    assert kv.lookup(NS_ID, [key(0)]) is NO_HITS
    assert kv.load(NS_ID, [key(0)]) == []
    with pytest.raises(ConnectionLost) as lost:
        kv.ping()
    assert isinstance(lost.value, Unreachable)
    with pytest.raises(ConnectionLost):
        Client.connect(peer.unix_path)
    kv.close()


def test_reconnects_and_retries_after_a_lost_connection(peer: Peer) -> None:
    blocks = make_blocks(2, 4096)
    keys = [k for k, _ in blocks]
    with Client(peer.unix_path) as kv:
        kv.save(NS_ID, blocks)
        first = kv.session
        peer.drop_connections()
        assert kv.lookup(NS_ID, keys).num_hits == 2  # the dead connection is noticed, then retried
        assert kv.session is not first and first.shm.closed  # old segments unmapped, new mapped
        peer.drop_on.add("acquire")
        assert kv.load(NS_ID, keys) == [r for _, r in blocks]
    assert peer.ops["hello"] == 3 and peer.ops["acquire"] == 2


def test_save_retries_only_before_commit(peer: Peer) -> None:
    a, b = make_blocks(1, 4096), make_blocks(1, 4096, tag=b"b")
    with Client(peer.unix_path, grant_bytes=0) as kv:
        peer.drop_on.add("reserve")
        assert kv.save(NS_ID, a) == ["stored"]  # lost before commit: retried from reserve
        assert peer.ops["reserve"] == 2
        peer.drop_on.add("commit")
        with pytest.raises(ConnectionLost):
            kv.save(NS_ID, b)  # lost during commit: not retried
        assert peer.ops["commit"] == 2 and peer.ops["reserve"] == 3
        assert kv.lookup(NS_ID, [b[0][0]]) is NO_HITS


def test_granted_save_retries_only_before_its_place(peer: Peer) -> None:
    a, b, c = (make_blocks(1, 4096, tag=t) for t in (b"ga", b"gb", b"gc"))
    with Client(peer.unix_path) as kv:
        assert kv.save(NS_ID, a) == ["stored"]  # reserve/commit; the grant fills the pool
        peer.drop_on.add("grant")
        assert kv.save(NS_ID, b) == ["stored"]  # refill lost before the place: retried (reserve)
        assert peer.ops["grant"] == 3 and peer.ops["reserve"] == 2 and peer.ops["place"] == 0
        peer.drop_on.add("place")
        with pytest.raises(ConnectionLost):
            kv.save(NS_ID, c)  # lost during the place: not retried
        assert peer.ops["place"] == 1 and peer.ops["reserve"] == 2
        assert kv.lookup(NS_ID, [c[0][0]]) is NO_HITS
        assert kv.load(NS_ID, [a[0][0], b[0][0]]) == [a[0][1], b[0][1]]


def test_a_refused_place_gives_its_grant_back(peer: Peer) -> None:
    a, b, c = (make_blocks(1, 4096, tag=t) for t in (b"ra", b"rb", b"rc"))
    with Client(peer.unix_path) as kv:
        assert kv.save(NS_ID, a) == ["stored"]  # reserve/commit; one slot granted for the next save
        (first,) = peer.grants
        peer.fail_on["place"] = InvalidRequest("refused")
        with pytest.raises(InvalidRequest):
            kv.save(NS_ID, b)  # into that slot; its place refused: the slot stays granted...
        assert first in peer.grants
        assert kv.save(NS_ID, c) == ["stored"]  # ...until the next save's requests release it
        assert first not in peer.grants
        assert kv.lookup(NS_ID, [b[0][0]]) is NO_HITS and kv.load(NS_ID, [c[0][0]]) == [c[0][1]]


def test_token_required(make_peer: Callable[..., Peer]) -> None:
    peer = make_peer(token="s3cret")
    tcp = f"tcp://127.0.0.1:{peer.tcp_port}"
    for token in (None, "wrong"):
        with pytest.raises(Unauthorized):
            Client.connect(tcp, token=token)
        with Client(tcp, token=token) as kv, pytest.raises(Unauthorized):
            kv.lookup(NS_ID, [key(0)])  # a refused token is never degraded into misses
    with Client(tcp, token="s3cret") as kv:
        assert kv.lookup(NS_ID, [key(0)]) is NO_HITS
    assert "s3cret" not in repr(kv.options)


def test_closed_client_refuses_calls(peer: Peer) -> None:
    kv = Client.connect(peer.unix_path)
    shm = kv.session.shm
    kv.close()
    assert shm.closed and kv.session is None
    with pytest.raises(ConnectionLost):
        kv.ping()
    kv.close()  # idempotent


def test_tensors_round_trip(peer: Peer) -> None:
    torch = pytest.importorskip("torch")
    from kvtier_protocol.namespace import Namespace

    ns = Namespace(model="tiny", revision="r1", attention="mha", num_layers=2, num_kv_heads=2,
                   head_dim=8, kv_dtype="float16", block_tokens=4, hash_tokens=4)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2, 2, 2, 4, 8, generator=gen).half() for _ in range(3)]
    hashes = [key(i, b"tensor") for i in range(3)]
    with Client(peer.unix_path) as kv:
        assert kv.save_tensors(ns, hashes, tensors) == ["stored"] * 3
        out = kv.load_tensors(ns, hashes)
        assert all(torch.equal(a, b) for a, b in zip(out, tensors))
        assert kv.load_tensors(ns, [key(9)]) == []
        header, _ = decode_header(kv.load(ns.ns_id, hashes[1:2])[0])
        assert header.ns_fields == ns.to_wire() and header.parent_hash == hashes[0]


@pytest.mark.parametrize("announced", [True, False])
def test_releases_go_quiet_only_to_a_daemon_that_announced_it(peer: Peer, announced: bool) -> None:
    peer.quiet_release = announced  # False: a daemon from before SPEC 7.4's quiet releases
    blocks = make_blocks(3, 4096)
    keys = [k for k, _ in blocks]
    with Client(peer.unix_path) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * 3
        for _ in range(3):  # each load's release: answered and dropped, or never answered
            assert kv.load(NS_ID, keys) == [r for _, r in blocks]
        assert kv.session.quiet_release is announced
        assert kv.ping() > 0
        assert eventually(lambda: peer.ops["release"] >= 3 and not peer.leases)
        assert (peer.last["release"].quiet is True) is announced
