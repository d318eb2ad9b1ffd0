"""The asyncio client on uvloop (the loop engines and the daemon use where it is installed): frames
go out as one ``writelines`` of the header and the caller's payload buffers, nothing joined or
copied (kvtier_protocol.frame_stream.writes_gathered), and arrive whole, also when they are far
larger than the socket buffers and while other requests travel beside them."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.client import AsyncClient
from tests.kvtier.client.clientkit import NS_ID, make_blocks
from tests.kvtier.client.peer import Peer

uvloop = pytest.importorskip("uvloop")
MiB = 1 << 20


def test_large_frames_are_written_gathered_and_arrive_whole_on_uvloop(peer: Peer) -> None:
    big = make_blocks(3, 3 * MiB, tag=b"uv-big")  # one 9 MiB put frame: beyond any socket buffer
    small = make_blocks(4, 64 << 10, tag=b"uv-small")

    async def main() -> None:
        async with AsyncClient(f"127.0.0.1:{peer.tcp_port}") as kv:
            await kv.ping()
            conn = kv._conn
            assert conn is not None and conn._gathers, "uvloop's transport sends the buffers as they are"
            saved = await asyncio.gather(kv.save(NS_ID, big), kv.save(NS_ID, small), kv.ping())
            assert saved[:2] == [["stored"] * 3, ["stored"] * 4]
            loaded = await asyncio.gather(kv.load(NS_ID, [k for k, _ in big]),
                                          kv.load(NS_ID, [k for k, _ in small]))
            assert loaded == [[r for _, r in big], [r for _, r in small]]

    uvloop.run(main())
