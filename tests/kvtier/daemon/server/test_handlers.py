"""The data plane's dispatch: an explicit table from each operation of the protocol to the one
method that serves it, and the typed error of an operation nobody serves."""

from __future__ import annotations

from typing import get_type_hints

import pytest
from kvtier_protocol import frames as fr
from kvtier_protocol.errors import InvalidRequest

from kvtier.daemon.server.handlers import RequestHandler, Session
from tests.kvtier.daemon.server.planekit import TOKEN, open_plane


async def test_every_operation_but_hello_has_exactly_one_handler(tmp_path):
    async with open_plane(tmp_path) as p:
        handler: RequestHandler = p.plane.handler
        table = handler.handlers
        # hello is the connection's (it picks the session's scope); every other op is here, once.
        assert sorted(table) == sorted(set(fr.OPS) - {fr.HelloRequest.OP})
        methods = [h.__func__ for h in table.values()]
        assert len(set(methods)) == len(methods), "two operations share a handler"
        for op, h in table.items():
            assert h.__self__ is handler
            # Each handler takes the request type of its op, as the protocol's table names it.
            assert get_type_hints(h)["req"] is fr.REQUESTS[op], op
        with pytest.raises(TypeError):
            table["ping"] = table["stats"]  # type: ignore[index]  # read-only: built once


async def test_requests_reach_their_handler_and_unknown_ops_get_invalid_request(tmp_path):
    async with open_plane(tmp_path) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        pong = await peer.call("ping")
        assert pong.header["ok"] is True and pong.op == "ping"
        stats = await peer.call("stats")
        assert stats.header["ok"] is True and stats.op == "stats"
        # An op the protocol does not have: the decoder's typed error, and the connection stays.
        reply = await peer.call("no-such-op")
        assert reply.header["ok"] is False and reply.header["err"]["code"] == InvalidRequest.code
        assert "unknown op 'no-such-op'" in reply.header["err"]["msg"]
        assert (await peer.call("ping")).header["ok"] is True
        # An op with no handler handed straight to the handler (hello is the connection's): the same.
        with pytest.raises(InvalidRequest, match="unknown op 'hello'"):
            await p.plane.handler.handle(fr.HelloRequest(id=1, version=1, client="test"), Session(tcp=True))
