"""GrantPool: the granted slots a connection holds for its next saves (and saves through them)."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.client import AsyncClient, Client
from kvtier.client.grants import HOST_FRACTION, LEASE_MARGIN, GrantPool, pool_limit
from tests.kvtier.client.clientkit import NS_ID, make_blocks
from tests.kvtier.client.peer import Peer
from tests.kvtier.waitkit import wait_until, wait_until_async

KIB = 1024


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def slots(n: int, size: int, base: int = 0) -> tuple:
    return tuple((0, base + i * size, size) for i in range(n))


def test_take_hands_out_whole_requests_oldest_grant_first() -> None:
    pool = GrantPool(1 << 20, clock=Clock())
    pool.add(4 * KIB, 0, 7, slots(2, 4 * KIB), 10_000, 100.0)
    pool.add(4 * KIB, 0, 8, slots(3, 4 * KIB, 1 << 16), 10_000, 100.0)
    assert pool.held(4 * KIB, 0) == 5
    assert pool.take(4 * KIB, 0, 6) is None and pool.held(4 * KIB, 0) == 5  # all or nothing
    assert pool.take(4 * KIB, 1, 1) is None and pool.take(8 * KIB, 0, 1) is None  # other shelves
    got = pool.take(4 * KIB, 0, 3)
    assert [(g.lease, g.position) for g in got] == [(7, 0), (7, 1), (8, 0)]
    assert got[2].slot == (0, 1 << 16, 4 * KIB)
    assert pool.held(4 * KIB, 0) == 2 and pool.take_stale() == []  # used up grants just leave


def test_nil_slots_and_a_zero_lease_add_nothing() -> None:
    pool = GrantPool(1 << 20, clock=Clock())
    pool.add(4 * KIB, 0, 0, (), 10_000, 100.0)
    pool.add(4 * KIB, 0, 9, slots(1, 4 * KIB) + (None, None), 10_000, 100.0)
    assert pool.held(4 * KIB, 0) == 1
    assert [g.position for g in pool.take(4 * KIB, 0, 1)] == [0]


def test_grants_past_half_their_lease_are_not_handed_out_but_released() -> None:
    clock = Clock()
    pool = GrantPool(1 << 20, clock=clock)
    pool.add(4 * KIB, 0, 7, slots(2, 4 * KIB), 10_000, 100.0)
    clock.t = 100.0 + LEASE_MARGIN * 10 - 0.001
    pool.add(4 * KIB, 0, 8, slots(2, 4 * KIB, 1 << 16), 10_000, clock.t)
    assert [g.lease for g in pool.take(4 * KIB, 0, 1)] == [7]
    clock.t += 0.002  # grant 7 is past its margin: its last slot is dropped
    assert [g.lease for g in pool.take(4 * KIB, 0, 2)] == [8, 8]
    assert pool.take_stale() == [7] and pool.take_stale() == []


def test_drop_forgets_every_slot_of_the_grants_and_releases_them() -> None:
    pool = GrantPool(1 << 20, clock=Clock())
    pool.add(4 * KIB, 0, 7, slots(2, 4 * KIB), 10_000, 100.0)
    pool.add(8 * KIB, 0, 8, slots(1, 8 * KIB, 1 << 16), 10_000, 100.0)
    pool.drop({7})
    assert pool.held(4 * KIB, 0) == 0 and pool.held(8 * KIB, 0) == 1
    assert pool.take_stale() == [7]


def test_fits_counts_what_other_shelves_hold() -> None:
    pool = GrantPool(64 * KIB, clock=Clock())
    assert pool.fits(4 * KIB, 16, 0) and not pool.fits(4 * KIB, 17, 0) and not pool.fits(0, 1, 0)
    pool.add(8 * KIB, 0, 7, slots(4, 8 * KIB), 10_000, 100.0)  # 32 KiB for other saves
    assert pool.fits(4 * KIB, 8, 0) and not pool.fits(4 * KIB, 9, 0)
    assert pool.fits(8 * KIB, 8, 0)  # its own shelf is what the save would use
    assert not GrantPool(0).fits(4 * KIB, 1, 0)


def test_pool_limit_is_a_share_of_the_host_segments() -> None:
    assert pool_limit(256 << 20, 4 << 30) == 256 << 20
    assert pool_limit(256 << 20, 1 << 30) == (1 << 30) // HOST_FRACTION
    assert pool_limit(0, 1 << 30) == 0


@pytest.mark.parametrize("driver", ["sync", "aio"])
@pytest.mark.parametrize("speaks, merged", [(True, True), (True, False), (False, False)],
                         ids=["place-grant", "grant-then-place", "no-grants"])
def test_saves_through_granted_slots_and_without_them(make_peer, speaks: bool, merged: bool, driver: str) -> None:
    peer: Peer = make_peer()
    peer.speaks_grants = speaks  # False: an older daemon, which refuses grant as an unknown op
    peer.place_grant = merged  # True: each place asks for the next save's slots (SPEC 7.4)
    chains = [make_blocks(4, 4 * KIB, tag=b"pool-%d" % i) for i in range(4)]
    if driver == "sync":
        with Client(peer.unix_path) as kv:
            saved = [kv.save(NS_ID, blocks) for blocks in chains]
            loaded = [kv.load(NS_ID, [k for k, _ in blocks]) for blocks in chains]
    else:
        async def run() -> tuple[list, list]:
            async with AsyncClient(peer.unix_path) as akv:
                return ([await akv.save(NS_ID, blocks) for blocks in chains],
                        [await akv.load(NS_ID, [k for k, _ in blocks]) for blocks in chains])
        saved, loaded = asyncio.run(run())
    assert saved == [["stored"] * 4] * 4
    assert loaded == [[r for _, r in blocks] for blocks in chains]
    if merged:  # the first save reserves and asks for a grant, each later one is one place
        assert peer.ops["reserve"] == 1 and peer.ops["place"] == 3 and peer.ops["grant"] == 1
        assert not peer.grants or peer.grants.keys() == {max(peer.grants)}  # the last refill, held
    elif speaks:  # the first save reserves, the others copy into the slots the one before got
        assert peer.ops["reserve"] == 1 and peer.ops["place"] == 3 and peer.ops["grant"] == 4
    else:  # the first refusal turns the pool off: every save reserves, one grant was tried
        assert peer.ops["reserve"] == 4 and peer.ops["grant"] == 1 and peer.ops["place"] == 0


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_slots_granted_by_a_daemon_that_hung_up_are_never_written(make_peer, driver: str) -> None:
    # A daemon killed and restarted adopts the same segments and may give the slots it granted
    # to other blocks: a client holding such slots must not copy into them (it reconnects and
    # saves through slots of the new connection instead).
    peer: Peer = make_peer()
    first, second = make_blocks(4, 4 * KIB, tag=b"before"), make_blocks(4, 4 * KIB, tag=b"after")

    def pool_slots(conn) -> list:
        pool = conn.session.grants
        return [g.slot for shelf in pool._shelves.values() for g in shelf.slots]

    def untouched(held: list, before: list[bytes]) -> bool:
        return [bytes(peer.mm[off:off + n]) for _, off, n in held] == before

    if driver == "sync":
        with Client(peer.unix_path) as kv:
            assert kv.save(NS_ID, first) == ["stored"] * 4  # reserves, and refills the pool
            conn = kv._conn
            held = pool_slots(conn)
            before = [bytes(peer.mm[off:off + n]) for _, off, n in held]
            peer.drop_connections()
            wait_until(conn.session.peer_gone, what="the client seeing the hang-up")
            assert kv.save(NS_ID, second) == ["stored"] * 4
            assert kv._conn is not conn
    else:
        async def run() -> tuple[list, list, list]:
            async with AsyncClient(peer.unix_path) as akv:
                assert await akv.save(NS_ID, first) == ["stored"] * 4
                conn = akv._conn
                held = pool_slots(conn)
                before = [bytes(peer.mm[off:off + n]) for _, off, n in held]
                peer.drop_connections()
                await wait_until_async(conn.session.peer_gone, what="the client seeing the hang-up")
                return held, before, await akv.save(NS_ID, second)
        held, before, saved = asyncio.run(run())
        assert saved == ["stored"] * 4
    assert len(held) == 4 and untouched(held, before)
    assert peer.ops["hello"] == 2 and peer.ops["place"] == 0  # the second save reserved on the new connection


def test_the_lease_a_forgotten_answer_must_release() -> None:
    from kvtier.client.steps import granted_lease
    ok = {"ok": True}
    assert granted_lease("grant", {**ok, "lease": 7}) == 7 and granted_lease("acquire", {**ok, "lease": 3}) == 3
    assert granted_lease("place", {**ok, "results": ["stored"], "grant_lease": 9}) == 9  # a place's refill
    assert granted_lease("place", {**ok, "results": ["stored"]}) == 0
    assert granted_lease("place", {**ok, "grant_lease": 0}) == 0
    assert granted_lease("grant", {"ok": False, "lease": 7}) == 0  # an error grants nothing
    assert granted_lease("ping", {**ok, "lease": 7}) == 0 and granted_lease("grant", {**ok, "lease": True}) == 0
