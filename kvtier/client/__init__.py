"""Clients of the kvtier daemon: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio).

Both speak the data plane of protocol/SPEC.md §7 over a unix socket (payloads through the
daemon's shared memory, whose segments arrive as descriptors at hello) or over TCP (payloads
inline, token required), and offer the same calls: ``lookup``, ``save``, ``load``, ``load_into``,
``get``, ``save_tensors``, ``load_tensors``, ``delete``, ``clear``, ``stats``, ``ping``, ``close``.

Given no address, a client connects to ``kvtier_protocol.address.default_address()``:
``$KVTIER_ADDRESS``, else ``$KVTIER_SOCKET``, else the socket ``kvtier serve`` listens on by default,
so ``kvtier.client.connect()`` finds a daemon started on its defaults. The operations are written
once, without I/O, in :mod:`kvtier.client.core` (see there for the modules and a save's path).

Importing this package loads none of the daemon's dependencies (aiohttp, RocksDB, Prometheus,
ZMQ) and no torch: the tensor helpers import torch when first called.
"""

from kvtier_protocol.address import Address, parse_address

from kvtier.client.aio import AsyncClient
from kvtier.client.core import NO_HITS, LookupResult
from kvtier.client.errors import ConnectionLost, TimedOut
from kvtier.client.get import GotRecord
from kvtier.client.options import ClientOptions
from kvtier.client.session import Session
from kvtier.client.sync import Client

connect = Client.connect
"""``connect(address=None, **options) -> Client``: a connected blocking client (no address: the
default one, ``kvtier_protocol.address.default_address()``)."""

connect_async = AsyncClient.connect
"""``await connect_async(address=None, **options) -> AsyncClient``: a connected asyncio client."""

__all__ = [
    "NO_HITS", "Address", "AsyncClient", "Client", "ClientOptions", "ConnectionLost",
    "GotRecord", "LookupResult", "Session", "TimedOut", "connect", "connect_async", "parse_address",
]
