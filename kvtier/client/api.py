"""What the blocking and the asyncio client share: argument checks and the flows of each call.

Arguments are checked (and records split) once, before any connection is made, so a malformed
call fails the same way whether or not the daemon is up; each ``_*_flow`` returns a factory that
starts the operation's flow on a session (one per attempt).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier_protocol.errors import InvalidKey, InvalidRequest, Unavailable
from kvtier_protocol.messages import check_token_info
from kvtier_protocol.wire_checks import PRIORITY_MAX, PRIORITY_MIN

from kvtier.client import flows, into
from kvtier.client.flows import Call, Flow
from kvtier.client.records import Block, Record, check_hashes, check_ns_id, prepare_records
from kvtier.client.session import Session
from kvtier.client.tensors import decode_blocks, encode_blocks

if TYPE_CHECKING:
    import torch

    from kvtier_protocol.namespace import Namespace

log = logging.getLogger("kvtier.client")

FlowFactory = Callable[[Session], Flow[Any]]


def degrade_error(address: object, exc: Unavailable) -> None:
    """Log that a call was answered with misses because the daemon is unavailable."""
    log.warning("kvtier daemon at %s unavailable (%s); answering misses", address, exc.message)


def _per_block(name: str, values: Sequence[Any] | None, n: int, item: Callable[[Any], Any]) -> list | None:
    if values is None:
        return None
    if len(values) != n:
        raise InvalidRequest(f"{name} has {len(values)} entries for {n} blocks")
    return [None if v is None else [item(x) for x in v] for v in values]


def _token(value: Any) -> int:
    try:
        token = operator.index(value)  # numpy and torch integers too, never floats
    except TypeError:
        token = -1
    if isinstance(value, bool) or token < 0:
        raise InvalidRequest(f"token ids are non-negative integers, got {value!r}")
    return token


def _unit_hash(value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidKey(f"unit hashes are bytes, got {type(value).__name__}")
    return bytes(value)


def _check_token_info(records: list[Record], tokens: list | None, units: list | None) -> None:
    """The rules of SPEC.md §7.4.1, checked before anything is sent."""
    for name, lists in (("tokens", tokens), ("unit_hashes", units)):
        if lists is not None and any(v is not None and not v for v in lists):
            raise InvalidRequest(f"save: a {name} entry is nil or a non-empty array")
    check_token_info("save", len(records), None if tokens is None else tuple(tokens),
                     None if units is None else tuple(units))
    for rec, unit_list in zip(records, units or ()):
        if unit_list is not None and unit_list[-1] != rec.key:
            raise InvalidRequest(f"save: the last unit hash of block {rec.key.hex()} is not its chain hash")


class ClientBase:
    """Flow factories and tensor helpers common to :class:`Client` and :class:`AsyncClient`."""

    __slots__ = ()

    @property
    def late_failures(self) -> int:
        """Write-behind commits that failed after their save returned, since the client was made
        (``ClientOptions.write_behind``; ``flush()`` raises them)."""
        conn = self._conn  # type: ignore[attr-defined]
        total: int = self._late.total  # type: ignore[attr-defined]
        return total + (conn.late.total if conn is not None else 0)

    @staticmethod
    def _lookup_flow(ns_id: bytes, hashes: Sequence[bytes]) -> FlowFactory:
        ns_id, keys = check_ns_id(ns_id), check_hashes(hashes)
        return lambda s: flows.lookup_flow(s, ns_id, keys)

    @staticmethod
    def _load_flow(ns_id: bytes, hashes: Sequence[bytes]) -> FlowFactory:
        ns_id, keys = check_ns_id(ns_id), check_hashes(hashes)
        return lambda s: flows.load_flow(s, ns_id, keys)

    @staticmethod
    def _load_into_flow(ns_id: bytes, hashes: Sequence[bytes], buffers: Sequence[Any]) -> FlowFactory:
        ns_id, keys = check_ns_id(ns_id), check_hashes(hashes)
        dests = into.check_buffers(buffers, len(keys))
        return lambda s: into.load_into_flow(s, ns_id, keys, dests)

    @staticmethod
    def _save_flow(ns_id: bytes, blocks: Sequence[Block], tokens: Sequence[Any] | None,
                   unit_hashes: Sequence[Any] | None, priority: int) -> FlowFactory:
        ns_id = check_ns_id(ns_id)
        records = prepare_records(ns_id, blocks)
        token_lists = _per_block("tokens", tokens, len(records), _token)
        unit_lists = _per_block("unit_hashes", unit_hashes, len(records), _unit_hash)
        _check_token_info(records, token_lists, unit_lists)
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InvalidRequest(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
        return lambda s: flows.save_flow(s, ns_id, records, token_lists, unit_lists, priority)

    @staticmethod
    def _delete_flow(ns_id: bytes, hashes: Sequence[bytes]) -> FlowFactory:
        ns_id, keys = check_ns_id(ns_id), check_hashes(hashes)
        return lambda s: flows.delete_flow(s, ns_id, keys)

    @staticmethod
    def _clear_flow(ns_id: bytes) -> FlowFactory:
        ns_id = check_ns_id(ns_id)

        def clear(s: Session) -> Flow[int]:
            return (yield Call("clear", {"ns_id": ns_id})).deleted
        return clear

    @staticmethod
    def _stats_flow() -> FlowFactory:
        def stats(s: Session) -> Flow[dict[str, Any]]:
            return (yield Call("stats")).stats
        return stats

    @staticmethod
    def _ping_flow() -> FlowFactory:
        def ping(s: Session) -> Flow[float]:
            start = time.perf_counter()
            yield Call("ping")
            return time.perf_counter() - start
        return ping

    @staticmethod
    def _encode(ns: Namespace, hashes: Sequence[bytes], tensors: Sequence[torch.Tensor], layout: str,
                codec: str, parents: Sequence[bytes | None] | None) -> list[Block]:
        return encode_blocks(ns, hashes, tensors, layout=layout, codec=codec, parents=parents)

    @staticmethod
    def _decode(records: list[bytes], layout: str | None, device: Any) -> list[torch.Tensor]:
        return decode_blocks(records, layout=layout, device=device) if records else []

