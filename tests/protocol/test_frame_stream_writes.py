"""kvtier_protocol.frame_stream.writes_gathered: which transports send a list of buffers as they
are. On those, a frame's header and payload buffers go out in one ``writelines``: the bytes that
arrive are the buffers back to back, also when the reader is slower than the writer."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading

import pytest

from kvtier_protocol import frames as fr
from kvtier_protocol.frame_stream import writes_gathered

MiB = 1 << 20


async def _write_frame_to_a_slow_reader(payload: list[bytes]) -> tuple[bool, bytes]:
    """Write one frame with ``writelines`` on the running loop's transport while a thread reads
    the other end 4 KiB at a time; returns (writes_gathered of that transport, bytes received)."""
    ours, theirs = socket.socketpair()
    got = bytearray()
    total = sum(len(b) for b in fr.encode_frame({"id": 1}, payload))

    def read() -> None:
        while len(got) < total:
            data = theirs.recv(4096)
            if not data:
                return
            got.extend(data)

    reader = threading.Thread(target=read)
    reader.start()
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, ours)
    try:
        gathered = writes_gathered(transport)
        transport.writelines(fr.encode_frame({"id": 1}, payload))
        await asyncio.to_thread(reader.join)
    finally:
        transport.close()
        theirs.close()
    return gathered, bytes(got)


def _payload() -> list[bytes]:
    return [bytes([i]) * (3 * MiB + i) for i in range(3)]  # far beyond the socket buffers


def test_uvloop_transports_gather_and_deliver_the_buffers_back_to_back() -> None:
    uvloop = pytest.importorskip("uvloop")
    payload = _payload()
    gathered, got = uvloop.run(_write_frame_to_a_slow_reader(payload))
    assert gathered
    assert got == fr.encode_frame_bytes({"id": 1}, payload)


def test_asyncios_own_transport_gathers_from_python_3_12() -> None:
    payload = _payload()
    gathered, got = asyncio.run(_write_frame_to_a_slow_reader(payload))
    assert gathered == (sys.version_info >= (3, 12))
    assert got == fr.encode_frame_bytes({"id": 1}, payload)
