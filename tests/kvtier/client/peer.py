"""A minimal data-plane peer for the client's unit tests: real frames, a toy store.

It speaks kvtier_protocol.frames (requests checked with ``validate_request``, responses built
from the typed response classes), hands one memfd segment to unix clients with SCM_RIGHTS, and
keeps blocks in that segment with a bump allocator. It runs its own event loop in a thread so
that blocking and asyncio clients can both talk to it. Knobs let tests stall it, delay ops (to
answer out of order), hold an op's answers until the test opens its gate, drop connections and count what clients sent. Not a daemon: the real one
is exercised by test_integration.py.
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
import os
import socket
import threading
from collections import Counter
from typing import Any

from kvtier_protocol import frames as F
from kvtier_protocol.errors import InvalidRequest, KVTierError, LeaseError, Unauthorized
from kvtier_protocol.header import decode_header, split_record, verify_payload

from tests.kvtier.waitkit import PATIENCE_S


class Peer:
    """Toy daemon on ``unix_path`` and 127.0.0.1:``tcp_port``."""

    def __init__(self, directory: str, *, token: str | None = None, segment_bytes: int = 32 << 20,
                 limits: F.Limits = F.DEFAULT_LIMITS) -> None:
        self.unix_path = os.path.join(directory, "peer.sock")
        self.tcp_port = 0
        self.token = token
        self.limits = limits
        self.fd = os.memfd_create("kvtier-client-peer")
        os.ftruncate(self.fd, segment_bytes)
        self.mm = mmap.mmap(self.fd, segment_bytes)
        self.size = segment_bytes
        self.next_offset = 0
        self.blocks: dict[tuple[bytes, bytes], tuple[bytes, tuple[int, int, int]]] = {}
        self.leases: dict[int, list[tuple[bytes, bytes, tuple[int, int, int]] | None]] = {}
        self.lease_ids = itertools.count(1)
        self.ops: Counter[str] = Counter()  # requests seen, by op
        self.arrivals: list[str] = []  # ops of the requests after hello, in the order they were read
        self.delays: dict[str, float] = {}  # op -> seconds to wait before answering
        self.gates: dict[str, threading.Event] = {}  # op -> answered only once the test sets it
        # op -> answered only once this many requests were in flight at once (or after PATIENCE_S,
        # so that a client that never overlaps them fails the test's assert instead of hanging)
        self.overlap: dict[str, int] = {}
        self.stalled = threading.Event()  # set: requests after hello are never answered
        self.drop_on: set[str] = set()  # ops whose next request aborts the connection unanswered
        self.last: dict[str, Any] = {}  # the last valid request of each op
        self.bad_reply: set[str] = set()  # ops answered "ok" without their required keys
        self.report_checked = False  # acquire says every block's payload was checked (as kvtierd's scrubber does)
        self.grants: dict[int, list[tuple[int, int, int] | None]] = {}  # grant -> slots not placed yet
        self.speaks_grants = True  # False: answers grant and place as an unknown op (an older daemon)
        self.fail_on: dict[str, KVTierError] = {}  # op -> the error its next request is answered with
        self.quiet_release = False  # True: hello announces quiet_release, quiet releases get no answer
        self.place_grant = False  # True: hello announces place_grant, a place makes its refill
        self.inflight = self.most_inflight = 0  # requests being answered now / at most so far
        self.writers: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    # -- lifecycle (called from the test thread) ---------------------------------------------

    def start(self) -> Peer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(5)
        return self

    async def _listen(self) -> None:
        self._servers.append(await asyncio.start_unix_server(self._serve_unix, self.unix_path))
        tcp = await asyncio.start_server(self._serve_tcp, "127.0.0.1", 0)
        self.tcp_port = tcp.sockets[0].getsockname()[1]
        self._servers.append(tcp)

    def drop_connections(self) -> None:
        """Abort every client connection (the clients see a reset or EOF)."""
        async def drop() -> None:
            for w in list(self.writers):
                w.transport.abort()
        asyncio.run_coroutine_threadsafe(drop(), self.loop).result(5)

    def stop(self) -> None:
        async def shutdown() -> None:
            for server in self._servers:
                server.close()
            for w in list(self.writers):
                w.transport.abort()
            for server in self._servers:
                await server.wait_closed()
        self.stalled.clear()
        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()
        self.mm.close()
        os.close(self.fd)

    # -- connections --------------------------------------------------------------------------

    async def _serve_unix(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(reader, writer, unix=True)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(reader, writer, unix=False)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, unix: bool) -> None:
        self.writers.add(writer)
        tasks: set[asyncio.Task] = set()
        owned: set[int] = set()  # leases granted on this connection
        try:
            hello = await F.read_frame(reader)
            if hello is None or not self._hello(hello, writer, unix):
                return
            while (frame := await F.read_frame(reader, self.limits)) is not None:
                task = asyncio.create_task(self._answer(frame, writer, unix, owned))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (KVTierError, ConnectionError):
            pass
        finally:
            # Like kvtierd, requests read before the end are still served; a stalled or slow one
            # is cut short.
            if tasks:
                await asyncio.wait(list(tasks), timeout=1.0)
            for task in tasks:
                task.cancel()
            for lease in owned:  # like kvtierd: a connection's leases end with it
                self.leases.pop(lease, None)
                self.grants.pop(lease, None)
            self.writers.discard(writer)
            writer.transport.abort()

    def _hello(self, frame: F.Frame, writer: asyncio.StreamWriter, unix: bool) -> bool:
        self.ops["hello"] += 1
        req = F.validate_request(frame)
        if self.token is not None and getattr(req, "token", None) != self.token:
            writer.writelines(F.encode_frame(F.error_response(req.id, Unauthorized("bad token"), "hello")))
            return False
        segments = (F.Segment("peer-0", self.size),) if unix else ()
        resp = F.HelloResponse(id=req.id, version=1, server="peer", limits=self.limits,
                               segments=segments, fds=len(segments),
                               features=tuple(f for f, on in ((F.QUIET_RELEASE, self.quiet_release),
                                                              (F.PLACE_GRANT, self.place_grant)) if on) or None)
        data = b"".join(F.encode_message(resp))
        if unix:  # descriptors travel with the frame's bytes: one sendmsg on a dup of the socket
            with socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno())) as s:
                socket.send_fds(s, [data], [self.fd])
        else:
            writer.write(data)
        return True

    async def _overlapped(self, want: int) -> None:
        """Wait until ``want`` requests were answered at once (see :attr:`overlap`)."""
        deadline = self.loop.time() + PATIENCE_S
        while self.most_inflight < want and self.loop.time() < deadline:
            await asyncio.sleep(0.005)

    async def _answer(self, frame: F.Frame, writer: asyncio.StreamWriter, unix: bool, owned: set[int]) -> None:
        op = frame.op or "?"
        self.ops[op] += 1
        self.arrivals.append(op)
        if self.stalled.is_set():
            return
        if op in self.drop_on:
            self.drop_on.discard(op)
            writer.transport.abort()
            return
        if op in self.bad_reply:
            writer.writelines(F.encode_frame({"op": op, "id": frame.id, "ok": True}))
            return
        self.inflight += 1
        self.most_inflight = max(self.most_inflight, self.inflight)
        try:
            await asyncio.sleep(self.delays.get(op, 0))
            gate = self.gates.get(op)
            while gate is not None and not gate.is_set():
                await asyncio.sleep(0.005)
            await self._overlapped(self.overlap.get(op, 0))
        finally:
            self.inflight -= 1
        try:
            req = F.validate_request(frame, limits=self.limits)
            self.last[op] = req
            if op in self.fail_on:
                raise self.fail_on.pop(op)
            if op in ("grant", "place") and not self.speaks_grants:
                raise InvalidRequest(f"unknown op {op!r}")
            if op in ("reserve", "commit", "acquire", "grant", "place") and not unix:
                raise InvalidRequest(f"{op} needs shared memory")
            resp: Any = getattr(self, f"_op_{op}")(req)
            if getattr(resp, "lease", 0):
                owned.add(resp.lease)
            if not self._quiet(req):
                writer.writelines(F.encode_message(resp))
        except KVTierError as exc:
            if not self._quiet(frame):
                writer.writelines(F.encode_frame(F.error_response(frame.id, exc, op)))

    def _quiet(self, req: Any) -> bool:
        """A release sent quiet to a peer that announced it: answered with nothing (SPEC 7.4)."""
        header = req.header if isinstance(req, F.Frame) else {"op": req.OP, "quiet": getattr(req, "quiet", None)}
        return self.quiet_release and header.get("op") == "release" and header.get("quiet") is True

    # -- the toy store -------------------------------------------------------------------------

    def _alloc(self, n: int) -> tuple[int, int, int] | None:
        if self.next_offset + n > self.size:
            return None
        slot = (0, self.next_offset, n)
        self.next_offset += n
        return slot

    def payload(self, slot: tuple[int, int, int]) -> bytes:
        return self.mm[slot[1]:slot[1] + slot[2]]

    def _op_lookup(self, r: F.LookupRequest) -> F.LookupResponse:
        hits = list(itertools.takewhile(lambda h: (r.ns_id, h) in self.blocks, r.hashes))
        return F.LookupResponse(id=r.id, num_hits=len(hits), tiers=("host",) * len(hits))

    def _op_reserve(self, r: F.ReserveRequest) -> F.ReserveResponse:
        slots: list[Any] = []
        for h, n in zip(r.hashes, r.sizes):
            slots.append(F.EXISTS if (r.ns_id, h) in self.blocks else self._alloc(n))
        entries = [None if not isinstance(s, tuple) else (r.ns_id, h, s) for h, s in zip(r.hashes, slots)]
        lease = next(self.lease_ids) if any(entries) else 0
        if lease:
            self.leases[lease] = entries
        return F.ReserveResponse(id=r.id, lease=lease, slots=tuple(slots))

    def _op_commit(self, r: F.CommitRequest) -> F.CommitResponse:
        entries = self.leases.pop(r.lease, None)
        if entries is None or len(entries) != len(r.headers):
            raise LeaseError(f"no reservation {r.lease}")
        staged = []
        for entry, hdr in zip(entries, r.headers):
            if hdr is None:
                continue
            if entry is None:
                raise InvalidRequest("header for a key without a slot")
            h, _ = decode_header(hdr)
            if (h.ns_id, h.chain_hash) != entry[:2] or h.payload_len != entry[2][2]:
                raise InvalidRequest("header does not match its reservation")
            verify_payload(h, self.payload(entry[2]))
            staged.append(((entry[0], entry[1]), (hdr, entry[2])))
        self.blocks.update(staged)
        return F.CommitResponse(id=r.id, committed=len(staged))

    def _op_grant(self, r: F.GrantRequest) -> F.GrantResponse:
        slots: list[tuple[int, int, int] | None] = []
        for n in r.sizes:
            slots.append(self._alloc(n) if not slots or slots[-1] is not None else None)
        lease = next(self.lease_ids) if any(slots) else 0
        if lease:
            self.grants[lease] = slots
        return F.GrantResponse(id=r.id, lease=lease, slots=tuple(slots))

    def _op_place(self, r: F.PlaceRequest) -> F.PlaceResponse:
        granted = self.grants.get(r.lease)
        if granted is None:
            raise LeaseError(f"no grant {r.lease}")
        staged, results = [], []
        for h, pos, hdr in zip(r.hashes, r.positions, r.headers):
            slot = granted[pos] if pos < len(granted) else None
            if slot is None or hdr is None:
                raise InvalidRequest(f"position {pos} is not granted")
            header, _ = decode_header(hdr)
            if (header.ns_id, header.chain_hash) != (r.ns_id, h) or header.payload_len != slot[2]:
                raise InvalidRequest("header does not match its key or slot")
            verify_payload(header, self.payload(slot))
            results.append("exists" if (r.ns_id, h) in self.blocks else "stored")
            staged.append(((r.ns_id, h), (hdr, slot)))
        for pos in r.positions:
            granted[pos] = None
        if not any(granted):
            del self.grants[r.lease]
        self.blocks.update(kv for kv, res in zip(staged, results) if res == "stored")
        if r.grant_sizes is None or not self.place_grant:
            return F.PlaceResponse(id=r.id, results=tuple(results))
        refill = self._op_grant(F.GrantRequest(r.id, r.grant_sizes))
        return F.PlaceResponse(id=r.id, results=tuple(results), grant_lease=refill.lease,
                               grant_slots=refill.slots if refill.lease else None)

    def _op_acquire(self, r: F.AcquireRequest) -> F.AcquireResponse:
        found = [self.blocks.get((r.ns_id, h)) for h in r.hashes]
        lease = next(self.lease_ids) if any(found) else 0
        if lease:
            self.leases[lease] = []
        checked = tuple(bool(f) for f in found) if self.report_checked else None
        return F.AcquireResponse(id=r.id, lease=lease, slots=tuple(f and f[1] for f in found),
                                 headers=tuple(f and f[0] for f in found), verified=checked)

    def _op_release(self, r: F.ReleaseRequest) -> F.ReleaseResponse:
        if r.lease and self.leases.pop(r.lease, None) is None and self.grants.pop(r.lease, None) is None:
            raise LeaseError(f"no lease {r.lease}")
        return F.ReleaseResponse(id=r.id)

    def _op_put(self, r: F.PutRequest) -> F.PutResponse:
        results = []
        for h, rec in zip(r.hashes, r.records()):
            hdr, payload = split_record(rec)
            verify_payload(hdr, payload)
            if (r.ns_id, h) in self.blocks:
                results.append("exists")
                continue
            slot = self._alloc(len(payload))
            if slot is None:
                results.append("full")
                continue
            self.mm[slot[1]:slot[1] + slot[2]] = payload
            self.blocks[(r.ns_id, h)] = (bytes(rec[:len(rec) - len(payload)]), slot)
            results.append("stored")
        return F.PutResponse(id=r.id, results=tuple(results))

    def _op_get(self, r: F.GetRequest) -> F.GetResponse:
        found = [self.blocks.get((r.ns_id, h)) for h in r.hashes]
        records = [hdr + self.payload(slot) for hdr, slot in filter(None, found)]
        return F.GetResponse(id=r.id, lens=tuple(f and len(f[0]) + f[1][2] for f in found),
                             payload=b"".join(records))

    def _op_delete(self, r: F.DeleteRequest) -> F.DeleteResponse:
        gone = [self.blocks.pop((r.ns_id, h), None) for h in r.hashes]
        return F.DeleteResponse(id=r.id, deleted=sum(g is not None for g in gone))

    def _op_clear(self, r: F.ClearRequest) -> F.ClearResponse:
        keys = [k for k in self.blocks if k[0] == r.ns_id]
        for k in keys:
            del self.blocks[k]
        return F.ClearResponse(id=r.id, deleted=len(keys))

    def _op_stats(self, r: F.StatsRequest) -> F.StatsResponse:
        return F.StatsResponse(id=r.id, stats={"blocks": len(self.blocks), "ops": dict(self.ops)})

    def _op_ping(self, r: F.PingRequest) -> F.PingResponse:
        return F.PingResponse(id=r.id)
