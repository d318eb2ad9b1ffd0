"""grant / place over the data plane: slots granted before their keys are known, raw frames."""

from __future__ import annotations

from kvtier.daemon.store.types import Tier
from tests.kvtier.daemon.server.planekit import BLOCK, NS, TOKEN, eventually, make_recs, open_plane
from tests.kvtier.daemon.server.test_dataplane import err, ok, shm_put, unix_peer


def write(peer, slot, payload: bytes) -> None:
    seg, off, _ = slot
    peer.maps[seg][off:off + len(payload)] = payload


async def test_granted_slots_placed_in_any_order_read_back_byte_identical(tmp_path):
    async with open_plane(tmp_path) as p:
        writer, _ = await unix_peer(p)
        reader, _ = await unix_peer(p)
        recs = make_recs(4)
        grant = ok(await writer.call("grant", sizes=[BLOCK] * 4))
        assert grant["lease"] and all(s is not None for s in grant["slots"])
        assert p.store.gauges().pending == 4
        order = [2, 0, 3, 1]  # block i goes into granted slot order[i]
        for rec, pos in zip(recs, order):
            write(writer, grant["slots"][pos], rec.payload)
        first = ok(await writer.call("place", lease=grant["lease"], ns_id=NS.ns_id,
                                     hashes=[r.chain_hash for r in recs[:2]], positions=order[:2],
                                     headers=[r.header for r in recs[:2]],
                                     tokens=[list(r.tokens) for r in recs[:2]]))
        assert first["results"] == ["stored", "stored"]
        rest = ok(await writer.call("place", lease=grant["lease"], ns_id=NS.ns_id,
                                    hashes=[r.chain_hash for r in recs[2:]], positions=order[2:],
                                    headers=[r.header for r in recs[2:]]))
        assert rest["results"] == ["stored", "stored"] and p.store.gauges().pending == 0
        got = ok(await reader.call("acquire", ns_id=NS.ns_id, hashes=[r.chain_hash for r in recs]))
        for rec, slot, header in zip(recs, got["slots"], got["headers"]):
            seg, off, length = slot
            assert header == rec.header and bytes(reader.maps[seg][off:off + length]) == rec.payload
        ok(await reader.call("release", lease=got["lease"]))
        # Used up: the grant ended, on the connection as in the store.
        assert err(await writer.call("release", lease=grant["lease"])) == "lease"
        assert [ns.ns_id for ns in p.store.namespaces()] == [NS.ns_id]
        await p.store.drain_scrub()
        assert p.store.counters.checksum_failures == 0


async def test_a_key_already_stored_is_answered_exists_and_its_slot_freed(tmp_path):
    async with open_plane(tmp_path) as p:
        peer, _ = await unix_peer(p)
        recs = make_recs(2)
        assert ok(await shm_put(peer, recs[:1]))["committed"] == 1
        grant = ok(await peer.call("grant", sizes=[BLOCK] * 3))
        for rec, slot in zip(recs, grant["slots"]):
            write(peer, slot, rec.payload)
        placed = ok(await peer.call("place", lease=grant["lease"], ns_id=NS.ns_id,
                                    hashes=[r.chain_hash for r in recs], positions=[0, 1],
                                    headers=[r.header for r in recs]))
        assert placed["results"] == ["exists", "stored"]
        assert p.store.index.used[Tier.HOST] == 3 * BLOCK  # 2 blocks and the slot still granted
        ok(await peer.call("release", lease=grant["lease"]))
        assert p.store.index.used[Tier.HOST] == 2 * BLOCK and p.store.gauges().leases == 0


async def test_grants_belong_to_their_connection_and_end_with_it(tmp_path):
    async with open_plane(tmp_path) as p:
        a, _ = await unix_peer(p)
        b, _ = await unix_peer(p)
        rec = make_recs(1)[0]
        grant = ok(await a.call("grant", sizes=[BLOCK, BLOCK]))
        place = dict(lease=grant["lease"], ns_id=NS.ns_id, hashes=[rec.chain_hash], positions=[0],
                     headers=[rec.header])
        assert err(await b.call("place", **place)) == "lease"  # another connection's grant
        reservation = ok(await a.call("reserve", ns_id=NS.ns_id, hashes=[make_recs(2)[1].chain_hash],
                                      sizes=[BLOCK]))
        assert err(await a.call("place", **{**place, "lease": reservation["lease"]})) == "lease"
        assert err(await a.call("commit", lease=grant["lease"], headers=[rec.header, None])) == "lease"
        assert err(await a.call("place", **{**place, "positions": [5]})) == "invalid_request"
        assert err(await a.call("place", **{**place, "headers": [make_recs(2)[1].header]})) == "bad_header"
        write(a, grant["slots"][0], rec.payload[:BLOCK // 2])  # killed mid-write
        assert p.store.gauges().pending == 3
        await a.close()
        await eventually(lambda: p.plane.num_connections == 1)
        assert p.store.gauges().pending == 0 and p.store.index.used[Tier.HOST] == 0
        assert p.store.lookup(NS.ns_id, [rec.chain_hash]).num_hits == 0
        # TCP connections get no segments, hence no grants.
        tcp = await p.connect(p.tcp, token=TOKEN)
        assert err(await tcp.call("grant", sizes=[BLOCK])) == "invalid_request"


async def test_a_bad_payload_fails_the_whole_place_under_verify_on_commit(tmp_path):
    async with open_plane(tmp_path, store={"verify_on_commit": True}) as p:
        peer, _ = await unix_peer(p)
        recs = make_recs(2)
        grant = ok(await peer.call("grant", sizes=[BLOCK] * 2))
        write(peer, grant["slots"][0], recs[0].payload)
        write(peer, grant["slots"][1], recs[0].payload)  # not recs[1]'s bytes
        frame = await peer.call("place", lease=grant["lease"], ns_id=NS.ns_id,
                                hashes=[r.chain_hash for r in recs], positions=[0, 1],
                                headers=[r.header for r in recs])
        assert err(frame) == "checksum_mismatch"
        assert p.store.lookup(NS.ns_id, [recs[0].chain_hash]).num_hits == 0  # all or nothing
        assert p.store.gauges().pending == 0 and p.store.index.used[Tier.HOST] == 0


async def test_a_place_asks_for_the_next_saves_slots(tmp_path):
    async with open_plane(tmp_path) as p:
        peer, hello = await unix_peer(p)
        assert "place_grant" in hello["features"]
        recs = make_recs(4)
        grant = ok(await peer.call("grant", sizes=[BLOCK] * 2))
        for rec, slot in zip(recs[:2], grant["slots"]):
            write(peer, slot, rec.payload)
        placed = ok(await peer.call("place", lease=grant["lease"], ns_id=NS.ns_id,
                                    hashes=[r.chain_hash for r in recs[:2]], positions=[0, 1],
                                    headers=[r.header for r in recs[:2]],
                                    grant_sizes=[BLOCK] * 2, grant_lease_ms=5000, grant_priority=1))
        assert placed["results"] == ["stored", "stored"]
        refill = placed["grant_lease"]
        assert refill and refill != grant["lease"] and all(s is not None for s in placed["grant_slots"])
        assert p.store.gauges().pending == 2  # the refill's slots, granted
        # The refill is a grant like any other: placed, used up, ended.
        for rec, slot in zip(recs[2:], placed["grant_slots"]):
            write(peer, slot, rec.payload)
        again = ok(await peer.call("place", lease=refill, ns_id=NS.ns_id,
                                   hashes=[r.chain_hash for r in recs[2:]], positions=[0, 1],
                                   headers=[r.header for r in recs[2:]]))
        assert again["results"] == ["stored", "stored"] and "grant_lease" not in again
        assert p.store.gauges().pending == 0 and p.store.lookup(NS.ns_id, [r.chain_hash for r in recs]).num_hits == 4
        assert err(await peer.call("release", lease=refill)) == "lease"


async def test_a_refill_the_store_refuses_leaves_the_place_standing(tmp_path):
    async with open_plane(tmp_path) as p:
        peer, _ = await unix_peer(p)
        rec = make_recs(1)[0]
        grant = ok(await peer.call("grant", sizes=[BLOCK] * 2))
        write(peer, grant["slots"][0], rec.payload)
        too_big = p.store.host.capacity + BLOCK  # no host tier could ever hold it
        placed = ok(await peer.call("place", lease=grant["lease"], ns_id=NS.ns_id, hashes=[rec.chain_hash],
                                    positions=[0], headers=[rec.header], grant_sizes=[too_big]))
        assert placed["results"] == ["stored"] and placed["grant_lease"] == 0 and "grant_slots" not in placed
        assert p.store.lookup(NS.ns_id, [rec.chain_hash]).num_hits == 1 and p.store.gauges().pending == 1
        # A refused place asks for nothing: its slots stay granted, no refill is made.
        assert err(await peer.call("place", lease=grant["lease"], ns_id=NS.ns_id, hashes=[rec.chain_hash],
                                   positions=[5], headers=[rec.header], grant_sizes=[BLOCK])) == "invalid_request"
        assert p.store.gauges().pending == 1 and len(p.store._leases) == 1
