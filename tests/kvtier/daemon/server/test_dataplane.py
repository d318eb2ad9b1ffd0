"""The data plane end to end in-process: a real store, a real DataPlane, raw frames on real sockets."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import socket
import stat
import tempfile
import weakref

import pytest
from kvtier_protocol import frames as fr
from kvtier_protocol.errors import StorageError

from kvtier.daemon.store.shm import map_segment
from kvtier.daemon.store.types import Tier
from tests.kvtier.daemon.server.planekit import (BIG_NS_ID, BLOCK, CLIENT_LIMITS, NS, TOKEN, Plane, big_record, eventually,
                                          make_recs, open_plane)


def ok(frame: fr.Frame) -> dict:
    assert frame.header["ok"] is True, frame.header
    return frame.header


def err(frame: fr.Frame) -> str:
    assert frame.header["ok"] is False, frame.header
    return frame.header["err"]["code"]


async def shm_put(peer, recs, **extra) -> fr.Frame:
    """reserve → write payloads through the peer's own mapping → commit."""
    res = ok(await peer.call("reserve", ns_id=NS.ns_id, hashes=[r.chain_hash for r in recs],
                             sizes=[len(r.payload) for r in recs]))
    for (seg, off, length), rec in zip(res["slots"], recs):
        peer.maps[seg][off:off + length] = rec.payload
    return await peer.call("commit", lease=res["lease"], headers=[r.header for r in recs], **extra)


async def unix_peer(p: Plane, **kw):
    peer = await p.connect(p.unix, hello=False)
    frame, fds = await peer.hello(**kw)
    hello = ok(frame)
    peer.maps = [memoryview(map_segment(fd, s["size"])) for fd, s in zip(fds, hello["segments"])]
    for fd in fds:
        os.close(fd)  # the mappings keep the segments
    return peer, hello


async def test_hello_passes_segments_and_the_client_maps_them(tmp_path):
    async with open_plane(tmp_path) as p:
        peer, hello = await unix_peer(p)
        assert hello["version"] == 1 and hello["fds"] == len(hello["segments"]) >= 1
        assert hello["limits"]["max_inflight"] == p.plane.cfg.max_inflight
        assert [s["size"] for s in hello["segments"]] == [s.size for s in p.store.host.segments]
        # What the client writes through its mapping is what the daemon's slot holds.
        rec = make_recs(1)[0]
        res = ok(await peer.call("reserve", ns_id=NS.ns_id, hashes=[rec.chain_hash], sizes=[BLOCK]))
        seg, off, length = res["slots"][0]
        peer.maps[seg][off:off + length] = rec.payload
        ok(await peer.call("release", lease=res["lease"]))
        assert p.store.lookup(NS.ns_id, [rec.chain_hash]).num_hits == 0


async def test_shared_memory_round_trip_is_byte_identical(tmp_path):
    async with open_plane(tmp_path) as p:
        writer, _ = await unix_peer(p)
        reader, _ = await unix_peer(p)
        recs = make_recs(3)
        assert ok(await shm_put(writer, recs))["committed"] == 3
        hashes = [r.chain_hash for r in recs] + [make_recs(1, seed=9)[0].chain_hash]
        look = ok(await reader.call("lookup", ns_id=NS.ns_id, hashes=hashes))
        assert look["num_hits"] == 3 and look["tiers"] == ["host"] * 3
        got = ok(await reader.call("acquire", ns_id=NS.ns_id, hashes=hashes))
        assert got["slots"][3] is None and got["headers"][3] is None
        for rec, (seg, off, length), header in zip(recs, got["slots"], got["headers"]):
            assert header == rec.header and bytes(reader.maps[seg][off:off + length]) == rec.payload
        ok(await reader.call("release", lease=got["lease"]))
        assert err(await reader.call("release", lease=got["lease"])) == "lease"
        # A reserve of stored keys reports them; the namespace came from the headers' ns_fields.
        again = ok(await writer.call("reserve", ns_id=NS.ns_id, hashes=[recs[0].chain_hash], sizes=[BLOCK]))
        assert again == {**again, "lease": 0, "slots": ["exists"]}
        assert [ns.ns_id for ns in p.store.namespaces()] == [NS.ns_id]


async def test_put_and_get_over_tcp_are_byte_identical(tmp_path):
    async with open_plane(tmp_path) as p:
        peer = await p.connect(p.tcp, hello=False)
        hello = ok((await peer.hello(TOKEN))[0])
        assert hello["segments"] == [] and hello["fds"] == 0
        recs = make_recs(3)
        lens = [len(r.record) for r in recs]
        put = ok(await peer.call("put", b"".join(r.record for r in recs), ns_id=NS.ns_id,
                                 hashes=[r.chain_hash for r in recs], lens=lens))
        assert put["results"] == ["stored"] * 3
        again = ok(await peer.call("put", recs[0].record, ns_id=NS.ns_id, hashes=[recs[0].chain_hash],
                                   lens=[lens[0]]))
        assert again["results"] == ["exists"]
        missing = make_recs(1, seed=5)[0].chain_hash
        got = await peer.call("get", ns_id=NS.ns_id, hashes=[r.chain_hash for r in recs] + [missing])
        assert ok(got)["lens"] == lens + [None]
        assert bytes(got.payload) == b"".join(r.record for r in recs)
        # The shared-memory operations need segments, which TCP connections do not get.
        assert err(await peer.call("reserve", ns_id=NS.ns_id, hashes=[missing], sizes=[BLOCK])) == "invalid_request"


async def test_put_is_all_or_nothing(tmp_path):
    async with open_plane(tmp_path) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        good, bad = make_recs(2)
        corrupt = bad.header + bytes([bad.payload[0] ^ 1]) + bad.payload[1:]
        frame = await peer.call("put", good.record + corrupt, ns_id=NS.ns_id,
                                hashes=[good.chain_hash, bad.chain_hash], lens=[len(good.record), len(corrupt)])
        assert err(frame) == "checksum_mismatch"
        swapped = await peer.call("put", good.record, ns_id=NS.ns_id, hashes=[bad.chain_hash],
                                  lens=[len(good.record)])
        assert err(swapped) == "invalid_request"
        assert p.store.lookup(NS.ns_id, [good.chain_hash]).num_hits == 0
        assert p.store.gauges().pending == 0 and p.store.gauges().leases == 0
        assert p.store.gauges().tiers[Tier.HOST].used_bytes == 0  # the slots it was copied into are free again
        ok(await peer.call("put", good.record, ns_id=NS.ns_id, hashes=[good.chain_hash], lens=[len(good.record)]))
        stale = good.header + bytes([good.payload[0] ^ 1]) + good.payload[1:]
        again = await peer.call("put", stale, ns_id=NS.ns_id, hashes=[good.chain_hash], lens=[len(stale)])
        assert err(again) == "checksum_mismatch"  # verified even where the key is stored already


async def test_an_inline_put_is_checked_as_it_is_copied_so_readers_need_not_hash_it(tmp_path):
    async with open_plane(tmp_path) as p:
        tcp = await p.connect(p.tcp, token=TOKEN)
        recs = make_recs(2, seed=11)
        ok(await tcp.call("put", b"".join(r.record for r in recs), ns_id=NS.ns_id,
                          hashes=[r.chain_hash for r in recs], lens=[len(r.record) for r in recs]))
        unix = await p.connect(p.unix)
        got = ok(await unix.call("acquire", ns_id=NS.ns_id, hashes=[r.chain_hash for r in recs]))
        assert got["verified"] == [True, True]  # at once: no background scrub was needed
        ok(await unix.call("release", lease=got["lease"]))


async def test_tcp_needs_the_token_and_the_socket_does_not(tmp_path):
    async with open_plane(tmp_path) as p:
        peer = await p.connect(p.tcp, hello=False)
        assert err(await peer.call("ping")) == "unauthorized"  # before hello
        assert err((await peer.hello())[0]) == "unauthorized"
        assert err((await peer.hello("wrong-token"))[0]) == "unauthorized"
        assert err((await peer.hello(TOKEN, version=2))[0]) == "unsupported_version"
        assert err(await peer.call("delete", ns_id=NS.ns_id, hashes=[])) == "unauthorized"
        ok((await peer.hello(TOKEN))[0])
        ok(await peer.call("ping"))
        assert err((await peer.hello(TOKEN))[0]) == "invalid_request"  # once per connection
        sock_peer = await p.connect(p.unix, hello=False)
        assert err(await sock_peer.call("ping")) == "invalid_request"
        ok((await sock_peer.hello())[0])
        wrong = await p.connect(p.unix, hello=False)
        assert err((await wrong.hello("wrong-token"))[0]) == "unauthorized"


async def test_socket_token_when_configured(tmp_path):
    async with open_plane(tmp_path, socket_requires_token=True) as p:
        peer = await p.connect(p.unix, hello=False)
        assert err(await peer.call("ping")) == "unauthorized"
        frame, fds = await peer.hello()
        assert err(frame) == "unauthorized" and fds == []
        frame, fds = await peer.hello(TOKEN)
        assert ok(frame)["fds"] == len(fds) >= 1
        for fd in fds:
            os.close(fd)


async def test_delete_and_clear_over_tcp(tmp_path):
    async with open_plane(tmp_path) as p:
        recs = make_recs(3)
        writer = await p.connect(p.tcp, token=TOKEN)
        ok(await writer.call("put", b"".join(r.record for r in recs), ns_id=NS.ns_id,
                             hashes=[r.chain_hash for r in recs], lens=[len(r.record) for r in recs]))
        anonymous = await p.connect(p.tcp, hello=False)
        assert err(await anonymous.call("delete", ns_id=NS.ns_id, hashes=[recs[0].chain_hash])) == "unauthorized"
        assert err(await anonymous.call("clear", ns_id=NS.ns_id)) == "unauthorized"
        assert p.store.lookup(NS.ns_id, [r.chain_hash for r in recs]).num_hits == 3
        assert ok(await writer.call("delete", ns_id=NS.ns_id, hashes=[recs[2].chain_hash]))["deleted"] == 1
        assert ok(await writer.call("clear", ns_id=NS.ns_id))["deleted"] == 2
        assert p.store.lookup(NS.ns_id, [recs[0].chain_hash]).num_hits == 0


async def test_client_gone_after_reserve_leaves_nothing(tmp_path):
    async with open_plane(tmp_path) as p:
        peer, _ = await unix_peer(p)
        rec = make_recs(1)[0]
        res = ok(await peer.call("reserve", ns_id=NS.ns_id, hashes=[rec.chain_hash], sizes=[BLOCK]))
        seg, off, length = res["slots"][0]
        peer.maps[seg][off:off + length // 2] = rec.payload[:length // 2]  # killed mid-write
        assert p.store.gauges().pending == 1
        await peer.close()
        await eventually(lambda: p.plane.num_connections == 0)
        assert p.store.gauges().pending == 0 and p.store.gauges().leases == 0
        assert p.store.lookup(NS.ns_id, [rec.chain_hash]).num_hits == 0
        # The key is free again: another client reserves it (not "pending" behind a dead lease).
        other, _ = await unix_peer(p)
        assert ok(await shm_put(other, [rec]))["committed"] == 1


async def test_commit_checks_the_lease_owner_and_ends_on_failure(tmp_path):
    async with open_plane(tmp_path) as p:
        a, _ = await unix_peer(p)
        b, _ = await unix_peer(p)
        recs = make_recs(2)
        res = ok(await a.call("reserve", ns_id=NS.ns_id, hashes=[recs[0].chain_hash], sizes=[BLOCK]))
        assert err(await b.call("commit", lease=res["lease"], headers=[recs[0].header])) == "lease"
        assert err(await a.call("commit", lease=res["lease"], headers=[recs[1].header])) == "bad_header"
        assert err(await a.call("release", lease=res["lease"])) == "lease"  # the failed commit ended it
        assert p.store.gauges().pending == 0


async def test_malformed_frame_closes_only_that_connection(tmp_path):
    async with open_plane(tmp_path) as p:
        bystander = await p.connect(p.tcp, token=TOKEN)
        bad = await p.connect(p.tcp, hello=False)
        await bad.send_bytes(b"XXXX" + bytes(16))
        reply = await bad.recv()
        assert reply.id == fr.CONNECTION_ERROR_ID and err(reply) == "bad_magic"
        assert await bad.recv() is None  # closed
        garbled = await p.connect(p.unix, hello=False)
        head = b"\x92\x01\x02"  # a msgpack array, not a map
        await garbled.send_bytes(fr.PREAMBLE.pack(fr.MAGIC, 1, 0, len(head), 0) + head)
        assert err(await garbled.recv()) == "bad_frame" and await garbled.recv() is None
        ok(await bystander.call("ping"))
        # A well-framed request with bad fields is answered with its id and keeps the connection.
        assert err(await bystander.call("lookup", ns_id=b"short", hashes=[])) == "invalid_request"
        assert err(await bystander.call("no-such-op")) == "invalid_request"
        ok(await bystander.call("ping"))


async def test_oversized_frame_is_refused_from_its_preamble(tmp_path):
    async with open_plane(tmp_path, max_payload_bytes=1 << 20) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        # Declares 1 GiB and sends none of it: the answer comes from the 20 preamble bytes alone.
        await peer.send_bytes(fr.PREAMBLE.pack(fr.MAGIC, 1, fr.FLAG_PAYLOAD, 16, 1 << 30))
        reply = await peer.recv()
        assert reply.id == fr.CONNECTION_ERROR_ID and err(reply) == "limit_exceeded"
        assert await peer.recv() is None


async def test_requests_beyond_max_inflight_are_busy(tmp_path):
    async with open_plane(tmp_path, max_inflight=2) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        # One write of many frames: the daemon reads them all before any request task runs.
        # (delete is served in a task of its own: a ping would be answered in the read loop.)
        frames = (fr.encode_frame_bytes({"op": "delete", "id": i, "ns_id": NS.ns_id, "hashes": [bytes(32)]})
                  for i in range(100, 140))
        await peer.send_bytes(b"".join(frames))
        replies = [await peer.recv() for _ in range(40)]
        assert sorted(r.id for r in replies) == list(range(100, 140))
        codes = [r.header["err"]["code"] for r in replies if not r.header["ok"]]
        assert codes and set(codes) == {"busy"} and len(codes) <= 38
        ok(await peer.call("ping"))


async def test_requests_answered_in_the_read_loop_are_never_busy(tmp_path):
    async with open_plane(tmp_path, max_inflight=2) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        # Pings are answered before the next frame is read: none is in flight when it comes,
        # and the answers leave in the order the requests came.
        await peer.send_bytes(b"".join(fr.encode_frame_bytes({"op": "ping", "id": i}) for i in range(100, 140)))
        replies = [await peer.recv() for _ in range(40)]
        assert [r.id for r in replies] == list(range(100, 140))
        assert all(r.header["ok"] for r in replies)


async def test_pipelined_requests_are_answered_out_of_order(tmp_path):
    big = 6 << 20  # its checksum and copy run on a worker thread: the ping overtakes it
    async with open_plane(tmp_path, host_bytes=16 << 20) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        key, record = big_record(big)
        await peer.send_bytes(fr.encode_frame_bytes(
            {"op": "put", "id": 1, "ns_id": BIG_NS_ID, "hashes": [key], "lens": [len(record)]}, record)
            + fr.encode_frame_bytes({"op": "ping", "id": 2}))
        first, second = await peer.recv(), await peer.recv()
        assert (first.id, second.id) == (2, 1)
        assert ok(second)["results"] == ["stored"]


async def test_max_connections_refuses_with_an_error_frame(tmp_path):
    async with open_plane(tmp_path, max_connections=1, max_tcp_connections=1) as p:
        for endpoint in (p.unix, p.tcp):  # each listener counts its own connections
            first = await p.connect(endpoint, token=TOKEN if endpoint == p.tcp else None)
            extra = await p.connect(endpoint, hello=False)
            reply = await extra.recv()
            assert reply.id == fr.CONNECTION_ERROR_ID and err(reply) == "busy"
            assert await extra.recv() is None
            ok(await first.call("ping"))


async def test_idle_connection_is_closed(tmp_path):
    async with open_plane(tmp_path, idle_timeout_s=0.2) as p:
        peer = await p.connect(p.unix)
        assert await peer.recv() is None
        await eventually(lambda: p.plane.num_connections == 0)


async def test_a_connection_stalled_inside_a_frame_is_closed(tmp_path):
    async with open_plane(tmp_path, idle_timeout_s=0.3) as p:
        peer = await p.connect(p.unix)
        whole = fr.encode_frame_bytes({"op": "ping", "id": 7}, limits=CLIENT_LIMITS)
        await peer.send_bytes(whole[:fr.PREAMBLE_LEN + 1])  # a preamble, then silence mid-header
        assert await peer.recv() is None  # closed: the stream cannot be resumed
        await eventually(lambda: p.plane.num_connections == 0)


async def test_a_connection_that_keeps_talking_outlives_the_idle_timeout(tmp_path):
    # The sleeps make the time pass that the daemon measures: 3 s of talk, never more than
    # 0.25 s silent, beside an idle timeout of 2 s (a margin for a loaded machine's scheduling).
    async with open_plane(tmp_path, idle_timeout_s=2.0) as p:
        peer = await p.connect(p.unix)
        for _ in range(12):
            await asyncio.sleep(0.25)
            ok(await peer.call("ping"))
        assert p.plane.num_connections == 1
        assert await peer.recv() is None  # and once silent, it goes
        await eventually(lambda: p.plane.num_connections == 0)


async def test_a_peer_that_stops_reading_its_answers_is_dropped(tmp_path):
    """Answers queue up in the daemon while the peer reads nothing; after the idle timeout the
    connection is dropped (its requests could never finish), and the daemon serves others."""
    async with open_plane(tmp_path, host_bytes=16 << 20, idle_timeout_s=0.5) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        key, record = big_record(4 << 20)
        ok(await peer.call("put", record, ns_id=BIG_NS_ID, hashes=[key], lens=[len(record)]))
        for i in range(40):  # 160 MiB of answers, far beyond the socket buffers; none read
            await peer.send({"op": "get", "id": 100 + i, "ns_id": BIG_NS_ID, "hashes": [key]})
        await eventually(lambda: p.plane.num_connections == 0)
        other = await p.connect(p.unix)
        ok(await other.call("ping"))


async def test_commit_tokens_reach_the_events(tmp_path):
    async with open_plane(tmp_path) as p:
        peer, _ = await unix_peer(p)
        recs = make_recs(2)
        q = p.ctx.events.subscribe()
        bad_units = [list(recs[0].unit_hashes[:-1]) + [recs[1].chain_hash], None]
        frame = await shm_put(peer, recs, tokens=[list(r.tokens) for r in recs], unit_hashes=bad_units)
        assert err(frame) == "invalid_request" and p.store.gauges().pending == 0
        frame = await shm_put(peer, recs, tokens=[list(r.tokens) for r in recs],
                              unit_hashes=[list(r.unit_hashes) for r in recs])
        assert ok(frame)["committed"] == 2
        p.ctx.events.publish(p.store.take_events(), {NS.ns_id: NS})
        stored = [q.get_nowait() for _ in range(q.qsize())]
        assert [e["token_ids"] for e in stored] == [list(r.tokens) for r in recs]
        # lookups count tokens of the registered namespace
        ok(await peer.call("lookup", ns_id=NS.ns_id, hashes=[r.chain_hash for r in recs]))
        body, _ = p.ctx.metrics.render()
        assert b"kvtier_lookup_hit_tokens_total 64.0" in body


async def test_stop_drains_releases_and_removes_the_socket(tmp_path):
    async with open_plane(tmp_path) as p:
        path = p.socket_path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        peer, _ = await unix_peer(p)
        rec = make_recs(1)[0]
        ok(await peer.call("reserve", ns_id=NS.ns_id, hashes=[rec.chain_hash], sizes=[BLOCK]))
        await p.plane.stop(1.0)
        assert not os.path.exists(path) and p.plane.num_connections == 0
        assert p.store.gauges().leases == 0
        assert await peer.recv() is None


async def test_stale_socket_is_replaced_and_live_or_foreign_paths_refused(tmp_path):
    sock_path = str(tmp_path / "s.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(sock_path)
    dead.close()  # a socket file nobody accepts on: what a killed daemon leaves
    async with open_plane(tmp_path, socket=sock_path, listen=None) as p:
        ok(await (await p.connect(p.unix)).call("ping"))
        with pytest.raises(StorageError, match="in use"):
            (tmp_path / "second").mkdir()
            async with open_plane(tmp_path / "second", socket=sock_path, listen=None):
                pass
    (tmp_path / "plain").write_text("not a socket")
    with pytest.raises(StorageError, match="not a socket"):
        async with open_plane(tmp_path, socket=str(tmp_path / "plain"), listen=None):
            pass
    assert (tmp_path / "plain").read_text() == "not a socket"


async def test_socket_path_at_the_length_limit(tmp_path):
    base = tempfile.mkdtemp(prefix="kvt-")
    try:
        path = os.path.join(base, "d" * (104 - len(base) - 3), "s")  # 104 bytes: no room for a temp name
        async with open_plane(tmp_path, socket=path, listen=None) as p:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            ok(await (await p.connect(p.unix)).call("ping"))
        assert not os.path.exists(path)
    finally:
        shutil.rmtree(base)


async def test_stats_over_the_wire(tmp_path):
    async with open_plane(tmp_path) as p:
        peer = await p.connect(p.unix)
        stats = ok(await peer.call("stats"))["stats"]
        assert stats["server"]["version"] == p.ctx.version and "host" in stats["tiers"]


async def test_put_tokens_reach_the_events(tmp_path):
    async with open_plane(tmp_path) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        recs = make_recs(2, seed=3)
        q = p.ctx.events.subscribe()
        ok(await peer.call("put", b"".join(r.record for r in recs), ns_id=NS.ns_id,
                           hashes=[r.chain_hash for r in recs], lens=[len(r.record) for r in recs],
                           tokens=[list(recs[0].tokens), None],
                           unit_hashes=[list(recs[0].unit_hashes), None]))
        p.ctx.events.publish(p.store.take_events(), {NS.ns_id: NS})
        stored = [q.get_nowait() for _ in range(q.qsize())]
        assert [e["token_ids"] for e in stored] == [list(recs[0].tokens), []]  # the second: placeholder


async def test_request_fields_and_token_keys_are_validated(tmp_path):
    async with open_plane(tmp_path, max_batch=4) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        rec = make_recs(1)[0]
        base = dict(ns_id=NS.ns_id, hashes=[rec.chain_hash], lens=[len(rec.record)])

        async def put(**extra) -> str:
            return err(await peer.call("put", rec.record, **base, **extra))

        assert await put(tokens=[[1, 2], [3]]) == "invalid_request"  # one entry per key
        assert await put(tokens=[[1, True]]) == "invalid_request"  # a bool is not a token id
        assert await put(tokens=[[-1]]) == "invalid_request"
        assert await put(tokens=[[]]) == "invalid_request"
        assert await put(tokens=[[0] * 65537]) == "limit_exceeded"
        assert await put(unit_hashes=[[rec.chain_hash]]) == "invalid_request"  # units need tokens
        assert await put(tokens=[list(rec.tokens)[:31]], unit_hashes=[list(rec.unit_hashes)]) == "invalid_request"
        assert await put(tokens=[list(rec.tokens)], unit_hashes=[[b"short"]]) == "invalid_request"
        hashes = [make_recs(1, seed=s)[0].chain_hash for s in range(5)]
        assert err(await peer.call("lookup", ns_id=NS.ns_id, hashes=hashes)) == "limit_exceeded"
        assert p.store.gauges().blocks == 0
        ok(await peer.call("put", rec.record, **base, tokens=[list(rec.tokens)], unit_hashes=None))


async def test_pooled_payload_buffers_carry_each_request_its_own_bytes(tmp_path):
    big = 3 << 20  # above POOLED_PAYLOAD_BYTES: puts are read into, gets copied into, pooled buffers
    async with open_plane(tmp_path, host_bytes=64 << 20) as p:
        peers = [await p.connect(p.tcp, token=TOKEN) for _ in range(2)]
        blocks = [big_record(big, seed=s) for s in range(6)]
        for i, (key, record) in enumerate(blocks):  # one after the other: each reuses the last buffer
            put = ok(await peers[i % 2].call("put", record, ns_id=BIG_NS_ID, hashes=[key], lens=[len(record)]))
            assert put["results"] == ["stored"]
        for i in range(0, len(blocks), 2):  # two gets at a time, one per connection
            gets = await asyncio.gather(*(peers[j].call("get", ns_id=BIG_NS_ID, hashes=[blocks[i + j][0]])
                                          for j in range(2)))
            assert [bytes(g.payload) for g in gets] == [blocks[i][1], blocks[i + 1][1]]
        both = await peers[0].call("get", ns_id=BIG_NS_ID, hashes=[k for k, _ in blocks[:2]])
        assert bytes(both.payload) == blocks[0][1] + blocks[1][1]
        assert p.plane.buffers.reused > 0  # the pool did hand buffers out again


async def test_large_payload_read_in_place_and_a_stream_ending_inside_it(tmp_path):
    big = 3 << 20  # above connection.POOLED_PAYLOAD_BYTES: received straight into a pooled buffer
    async with open_plane(tmp_path, host_bytes=16 << 20) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        key, record = big_record(big)
        stored = ok(await peer.call("put", record, ns_id=BIG_NS_ID, hashes=[key], lens=[len(record)]))
        assert stored["results"] == ["stored"]
        got = await peer.call("get", ns_id=BIG_NS_ID, hashes=[key])
        assert bytes(got.payload) == record
        cut = await p.connect(p.tcp, token=TOKEN)
        other_key, other = big_record(big, seed=2)
        frame = fr.encode_frame_bytes({"op": "put", "id": 7, "ns_id": BIG_NS_ID, "hashes": [other_key],
                                       "lens": [len(other)]}, other)
        await cut.send_bytes(frame[:len(frame) - (1 << 20)])
        cut.raw.sock.shutdown(socket.SHUT_WR)  # the stream ends 1 MiB short of the payload
        assert await cut.recv() is None  # closed without an answer; nothing stored
        assert ok(await peer.call("lookup", ns_id=BIG_NS_ID, hashes=[other_key]))["num_hits"] == 0


async def test_received_payloads_wait_for_room_in_the_daemons_byte_budget(tmp_path):
    """max_buffer_bytes bounds payload bytes held by all connections together: a second put
    waits, unread, while a first one holds the budget, and goes through once it is released."""
    size = 2 << 20
    async with open_plane(tmp_path, host_bytes=16 << 20, max_payload_bytes=size, max_buffer_bytes=size,
                          max_connection_buffer_bytes=size) as p:
        key, record = big_record(size - 4096, seed=1)
        head = {"op": "put", "id": 1, "ns_id": BIG_NS_ID, "hashes": [key], "lens": [len(record)]}
        whole = fr.encode_frame_bytes(head, record)
        first, second = await p.connect(p.tcp, token=TOKEN), await p.connect(p.tcp, token=TOKEN)
        cut = len(whole) - len(record) // 2
        await first.send_bytes(whole[:cut])  # announced in full, half sent: charged in full
        await eventually(lambda: p.plane.budget.used == len(record))
        key2, record2 = big_record(size - 4096, seed=2)
        await second.send_bytes(fr.encode_frame_bytes({**head, "hashes": [key2]}, record2))
        await eventually(lambda: len(p.plane.budget._waiters) == 1)  # no room: it waits, unread
        await first.send_bytes(whole[cut:])
        assert ok(await first.recv())["results"] == ["stored"]
        assert ok(await second.recv())["results"] == ["stored"]
        await eventually(lambda: p.plane.budget.used == 0)


async def test_a_stranger_may_not_send_a_payload_before_hello(tmp_path):
    async with open_plane(tmp_path) as p:
        peer = await p.connect(p.tcp, hello=False)
        await peer.send_bytes(fr.encode_frame_bytes({"op": "ping", "id": 1}, b"x" * 16))
        reply = await peer.recv()
        assert reply.id == fr.CONNECTION_ERROR_ID and err(reply) == "limit_exceeded"
        assert await peer.recv() is None
        await eventually(lambda: p.plane.num_unauthenticated == 0)


async def test_a_closed_connection_is_freed_without_the_cyclic_collector(tmp_path):
    """The daemon freezes what lives through a collection out of the collector's walks
    (kvtier.daemon.server.collector): a connection must not need the collector once it is over.
    Its protocol, writer, transport and task referred to each other, so every closed connection
    kept its 64 KiB scratch buffer and more until the hourly full collection (the soak's daemon
    grew ~1 MiB every 5 s of reconnecting clients). Here the collector is off while it closes."""
    async with open_plane(tmp_path) as p:
        peer = await p.connect(p.unix)
        ok(await peer.call("ping"))
        (conn,) = p.plane._conns
        stream, served = weakref.ref(conn.reader), weakref.ref(conn)
        del conn
        gc.collect()
        gc.disable()
        try:
            await peer.close()
            await eventually(lambda: p.plane.num_connections == 0)
            await eventually(lambda: stream() is None and served() is None)
        finally:
            gc.enable()


async def test_quiet_release_ends_the_lease_and_is_never_answered(tmp_path):
    async with open_plane(tmp_path) as p:
        writer, _ = await unix_peer(p)
        reader, hello = await unix_peer(p)
        assert fr.QUIET_RELEASE in hello["features"]
        recs = make_recs(2)
        assert ok(await shm_put(writer, recs))["committed"] == 2
        got = ok(await reader.call("acquire", ns_id=NS.ns_id, hashes=[r.chain_hash for r in recs]))
        assert len(p.store._leases) == 1
        await reader.send({"op": "release", "lease": got["lease"], "quiet": True})
        # An unknown lease, quiet too: no error answered either, the connection goes on.
        await reader.send({"op": "release", "lease": got["lease"] + 1000, "quiet": True})
        # The next answer on the stream is the ping's: neither release wrote one.
        ping = await reader.send({"op": "ping"})
        assert ok(await reader.recv())["id"] == ping
        assert len(p.store._leases) == 0
        # Handled in order like any other request: the lease is gone for a second release.
        assert err(await reader.call("release", lease=got["lease"])) == "lease"
        # `quiet` that is not a bool is the request's error, answered as usual.
        assert err(await reader.call("release", lease=0, quiet=1)) == "invalid_request"
        m = p.ctx.metrics.registry.get_sample_value(
            "kvtier_requests_total", {"op": "release", "status": "lease"})
        assert m is not None and m >= 2  # the quiet failure is counted with the answered one


async def test_a_release_is_never_busy(tmp_path):
    async with open_plane(tmp_path, max_inflight=2) as p:
        peer, _ = await unix_peer(p)
        recs = make_recs(1)
        assert ok(await shm_put(peer, recs))["committed"] == 1
        got = ok(await peer.call("acquire", ns_id=NS.ns_id, hashes=[recs[0].chain_hash]))
        # Behind 20 deletes (each in a task of its own, so the in-flight limit is reached) a
        # quiet release and an answered one: both are served, neither is `busy`.
        deletes = [fr.encode_frame_bytes({"op": "delete", "id": i, "ns_id": NS.ns_id, "hashes": [bytes(32)]})
                   for i in range(100, 120)]
        quiet = fr.encode_frame_bytes({"op": "release", "id": 200, "lease": got["lease"], "quiet": True})
        answered = fr.encode_frame_bytes({"op": "release", "id": 201, "lease": 0})
        await peer.send_bytes(b"".join([*deletes, quiet, answered]))
        replies = {r.id: r for r in [await peer.recv() for _ in range(21)]}
        assert sorted(replies) == [*range(100, 120), 201]  # nothing for the quiet one
        assert ok(replies[201])
        assert {err(r) for i, r in replies.items() if i != 201 and not r.header["ok"]} <= {"busy"}
        assert len(p.store._leases) == 0
