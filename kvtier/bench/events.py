"""`kvtier bench events`: KV events per second through the daemon's publisher to a subscriber.

The daemon's own :class:`kvtier.daemon.server.events.EventHub` (translation to vLLM 0.33 events, merging
into runs, msgpack encoding on its sender thread, a ZMQ PUB socket on tcp loopback) runs in this
process, fed what the store and the data plane feed it in the daemon: ``note_blocks`` with each
stored block's tokens and hash-unit digests, then ``publish`` of ``--batch`` store events at a
time (what the daemon's 20 ms pump collects at about 100K events/s). A subscriber process (a ZMQ
SUB socket, as a router such as llm-d runs) receives every message and decodes it with
:func:`kvtier_protocol.events.decode_batch`, counting the block hashes it finds.

The workload, per ``--geometry`` (``block_tokens/hash_tokens``): chains of ``--chain`` blocks,
each block with its tokens and ``block_tokens / hash_tokens`` unit digests; every publish of
stored blocks is followed by a publish of their removal, so half the events are
``BlockStored`` (with tokens) and half ``BlockRemoved``. An event in every figure is one store
event: one block appearing in or leaving one tier, i.e. one per-block ``BlockStored`` /
``BlockRemoved`` as vLLM emits them per KV block (the daemon merges consecutive ones of a chain
into fewer, larger vLLM events on the wire; the subscriber counts the block hashes it decodes).

Rows (events/s, higher is better), per geometry:
  * ``published``: from the first ``note_blocks`` until the sender thread has handed the last
    batch to the PUB socket, next to raw pyzmq sending the same bytes (the batches as the hub
    encodes them, made beforehand) from one thread.
  * ``received + decoded``: until the subscriber has decoded the last batch, next to the same
    raw messages received by the same subscriber process without decoding: the transport floor.
  * ``decode only``: :func:`decode_batch` of every batch in this process, next to
    ``msgpack.unpackb`` of the same bytes: how close the checked decoder is to msgpack itself.

The process runs under the daemon's garbage-collector policy (``daemon.gc_freeze``, on by default;
:mod:`kvtier.daemon.server.collector`): the youngest generation's threshold raised to
:data:`~kvtier.daemon.server.collector.GEN0_THRESHOLD` and what is alive once a workload is made
frozen, so collections skip it as the daemon's skip its index. Without it, every full collection
walked the pre-made workload (~20% of a 256-token repetition), a cost the daemon does not have.

Each geometry is measured again in kvtier's packed form (SPEC.md §9.8, the hub's opt-in
``packed_endpoint``: token ids as little-endian u32 bins, decoded with ``decode_batch(...,
packed=True)`` into arrays), a separate case with the same three rows against raw pyzmq and
msgpack on the packed bytes. The vLLM-compatible rows above are what llm-d and vLLM consumers get.

And one case of ``publish`` call latency (ms, p99 and slowest of :data:`STUCK_PUBLISHES` calls of
500 events, PUB high-water mark 1) beside a subscriber that joined and never reads, next to the
same calls with nobody subscribed: ``publish`` only queues for the sender thread, and PUB drops
what a stuck subscriber does not take, so it must not slow the caller (the store's event pump).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import multiprocessing as mp
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgpack
import zmq

from kvtier.bench.report import (Row, Samples, SuiteResult, Timer, alternate_many, latency_row,
                                 progress, quantile, throughput_row)
from kvtier.daemon.config import EventsConfig
from kvtier.daemon.server.collector import GEN0_THRESHOLD
from kvtier.daemon.server.event_translate import BlockTokens, EventTranslator
from kvtier.daemon.server.events import EventHub
from kvtier.daemon.store.stats import EventKind, StoreEvent
from kvtier.daemon.store.types import Tier
from kvtier_protocol.errors import KVTierError
from kvtier_protocol.events import decode_batch, encode_wire_batch
from kvtier_protocol.namespace import Namespace

DESCRIPTION = "KV events published and received (decoded) per second vs raw pyzmq PUB/SUB"
TOPIC = "kv@bench@kvtier"
PROBE_SEQ = b"\xff" * 8  # raw probe messages; kvtier probes are GPU-tier events, the workload's are CPU
IDLE_TIMEOUT_S = 5.0  # a subscriber that hears nothing this long reports what it got
STUCK_PUBLISHES = 100  # of 500 events each: ~2 MB beyond what the stuck subscriber's buffers hold


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", default=None,
                        help="block_tokens/hash_tokens pairs (default 256/16,16/16; --quick 256/16)")
    parser.add_argument("--events", type=int, default=None,
                        help="store events per repetition (default 100000; --quick 8192)")
    parser.add_argument("--batch", type=int, default=2048, help="store events per publish (default 2048)")
    parser.add_argument("--chain", type=int, default=32, help="blocks per prefix chain (default 32)")


def run(args: argparse.Namespace) -> SuiteResult:
    reps = args.repetitions or (2 if args.quick else 5)
    geometries = [tuple(int(v) for v in g.split("/")) for g in
                  (args.geometry or ("256/16" if args.quick else "256/16,16/16")).split(",")]
    total = args.events or (8192 if args.quick else 100_000)
    batch = max(1, args.batch)
    result = SuiteResult("events")
    ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of this process's sockets or threads
    parent, child = ctx.Pipe()
    # A short replay buffer: appending costs the same at any length, and the daemon's default
    # (10000 batches) would keep every 2.4 MB batch of the run alive.
    hub = EventHub(EventsConfig(endpoint="tcp://127.0.0.1:*", topic=TOPIC, buffer_steps=64))
    # The packed form on a hub of its own: publishing it costs no vLLM-form encoding.
    packed_hub = EventHub(EventsConfig(endpoint=None, topic=TOPIC, buffer_steps=64),
                          packed_endpoint="tcp://127.0.0.1:*")
    zctx = zmq.Context()
    raw = zctx.socket(zmq.PUB)
    raw.setsockopt(zmq.SNDHWM, EventsConfig().hwm)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind("tcp://127.0.0.1:*")
    sub = ctx.Process(target=_subscriber, args=(child, {"kvtier": hub.start()[0], "packed": packed_hub.start()[0],
                                                        "raw": raw.getsockopt_string(zmq.LAST_ENDPOINT)}),
                      name="kvtier-bench-events-sub", daemon=True)
    sub.start()
    threshold = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, *threshold[1:])  # the daemon's policy (see the module doc)
    try:
        _expect(parent, "connected", 60.0)
        for block_tokens, hash_tokens in geometries:
            work = Workload.make(block_tokens, hash_tokens, total, batch, args.chain)
            gc.freeze()  # the workload, as the daemon freezes its long-lived objects
            progress(f"events: {block_tokens}-token blocks, {work.units} hashes each: {work.events} events "
                     f"in {len(work.publishes)} publishes of {batch}, {reps} repetitions")
            result.rows += _rows(work, hub, packed_hub, raw, parent, reps)
        result.rows += _stuck_rows(zctx, reps)
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
        parent.send(("stop",))
        sub.join(10)
        if sub.is_alive():
            sub.kill()
        hub.close()
        packed_hub.close()
        raw.close()
        zctx.term()
    return result


# --- the workload ------------------------------------------------------------------------------


@dataclass(slots=True)
class Workload:
    """Pre-made inputs of one repetition: what the store and the data plane hand the hub."""

    ns: Namespace
    units: int  # hash units per block
    events: int  # store events over all publishes
    notes: list[list[BlockTokens]]  # per publish: blocks to note first (empty for removals)
    publishes: list[list[StoreEvent]]
    batches: list[bytes]  # each publish's batch as the hub encodes it (the raw baseline's messages)
    packed_batches: list[bytes]  # the same in the packed form (SPEC.md §9.8)

    @classmethod
    def make(cls, block_tokens: int, hash_tokens: int, total: int, batch: int, chain: int) -> Workload:
        ns = Namespace(model="bench/events", revision="0", attention="mha", num_layers=32, num_kv_heads=8,
                       head_dim=128, block_tokens=block_tokens, hash_tokens=hash_tokens)
        units = ns.units_per_block
        notes: list[list[BlockTokens]] = []
        publishes: list[list[StoreEvent]] = []
        block = 0
        while sum(map(len, publishes)) < total:
            stored, noted = [], []
            for _ in range(batch):
                digests = [_digest(block, u) for u in range(units)]
                parent = _digest(block - 1, units - 1) if block % chain else None
                # as the data plane hands them over: the request's ids decoded into an array
                # (kvtier_protocol.messages.token_lists)
                tokens = array("I", [(block * block_tokens + t) % 128_000 for t in range(block_tokens)])
                noted.append(BlockTokens(digests[-1], parent, tokens, tuple(digests)))
                stored.append(StoreEvent(EventKind.STORED, Tier.HOST, ns.ns_id, digests[-1], parent, block_tokens))
                block += 1
            notes += [noted, []]
            publishes += [stored, [StoreEvent(EventKind.REMOVED, e.tier, e.ns_id, e.chain_hash, e.parent_hash,
                                              e.num_tokens) for e in stored]]
        batches, packed = _encoded(ns, notes, publishes)
        return cls(ns, units, sum(map(len, publishes)), notes, publishes, batches, packed)


def _digest(block: int, unit: int) -> bytes:
    return hashlib.blake2b(block.to_bytes(8, "little", signed=True) + unit.to_bytes(4, "little"),
                           digest_size=32).digest()


def _encoded(ns: Namespace, notes: list[list[BlockTokens]], publishes: list[list[StoreEvent]]
             ) -> tuple[list[bytes], list[bytes]]:
    """What the hub will put on the wire for each publish (same translation, merge and encoding),
    in the vLLM form and in the packed form."""
    translator = EventTranslator()
    out: list[bytes] = []
    packed: list[bytes] = []
    for noted, events in zip(notes, publishes):
        translator.note_blocks(ns.ns_id, noted)
        runs = translator.translate_runs(events, {ns.ns_id: ns})
        ts = time.time()
        out.append(encode_wire_batch(ts, [r.wire() for r in runs], 0))
        packed.append(encode_wire_batch(ts, [r.packed() for r in runs], 0))
    return out, packed


# --- measuring ---------------------------------------------------------------------------------


def _rows(work: Workload, hub: EventHub, packed_hub: EventHub, raw: zmq.Socket, conn: Connection,
          reps: int) -> list[Row]:
    for name, h in (("kvtier", hub), ("packed", packed_hub)):
        _probe(conn, name, lambda h=h: h.publish([StoreEvent(EventKind.STORED, Tier.GPU, work.ns.ns_id,
                                                             bytes(32), None, 0)], {}))
    _probe(conn, "raw", lambda: raw.send_multipart([TOPIC.encode(), PROBE_SEQ, b"probe"]))
    published: dict[str, list[float]] = {"kvtier": [], "raw": [], "packed": [], "raw packed": []}
    received: dict[str, list[float]] = {"kvtier": [], "raw": [], "packed": [], "raw packed": []}
    namespaces = {work.ns.ns_id: work.ns}

    def through(name: str, h: EventHub) -> Callable[[], float]:
        stats = h.zmq_stats if name == "kvtier" else h.packed_stats
        assert stats is not None, "the hub was made with that endpoint"

        def once() -> float:
            conn.send(("measure", name, work.events * work.units))
            _expect(conn, "armed", 30.0)
            sent_before = stats.batches_sent
            start = time.monotonic()
            for noted, events in zip(work.notes, work.publishes):
                if noted:
                    h.note_blocks(work.ns.ns_id, noted)
                h.publish(events, namespaces)
            while stats.batches_sent - sent_before < len(work.publishes):
                if time.monotonic() - start > 300:
                    raise RuntimeError("events: the hub's sender thread did not send every batch within 300 s")
                time.sleep(0.0005)
            pub_s = time.monotonic() - start
            return _record(conn, name, start, pub_s, work.events, work.events * work.units, published, received)
        return once

    def baseline(key: str, payloads: list[bytes]) -> Callable[[], float]:
        def once() -> float:
            conn.send(("measure", "raw", len(payloads)))
            _expect(conn, "armed", 30.0)
            topic = TOPIC.encode()
            start = time.monotonic()
            for seq, payload in enumerate(payloads):
                raw.send_multipart([topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK, copy=False)
            pub_s = time.monotonic() - start
            return _record(conn, key, start, pub_s, work.events, len(payloads), published, received)
        return once

    alternate_many([through("kvtier", hub), baseline("raw", work.batches), through("packed", packed_hub),
                    baseline("raw packed", work.packed_batches)], repetitions=reps)
    case = f"{work.ns.block_tokens}-token blocks ({work.units} hashes), {len(work.publishes[0])} per publish"
    packed_case = f"{case}, packed token ids (SPEC 9.8)"
    progress(f"events: {case}: decode_batch vs msgpack.unpackb of the same batches, in process")
    decoded, unpacked, p_decoded, p_unpacked = alternate_many(
        [_decoder(work.batches, work.events, decode_batch), _decoder(work.batches, work.events, _unpack),
         _decoder(work.packed_batches, work.events, _decode_packed),
         _decoder(work.packed_batches, work.events, _unpack)], repetitions=reps)
    rows = []
    for c, k, r, dec, unp in ((case, "kvtier", "raw", decoded, unpacked),
                              (packed_case, "packed", "raw packed", p_decoded, p_unpacked)):
        rows += [
            throughput_row(c, "published", "events/s", Samples(published[k][1:]),
                           "raw pyzmq PUB, same bytes", Samples(published[r][1:])),
            throughput_row(c, "received + decoded", "events/s", Samples(received[k][1:]),
                           "raw pyzmq PUB/SUB, same bytes", Samples(received[r][1:])),
            throughput_row(c, "decode only", "events/s", dec, "msgpack.unpackb, same bytes", unp),
        ]
    return rows


def _stuck_rows(zctx: zmq.Context, reps: int) -> list[Row]:
    """``publish`` call latency beside a subscriber that never reads vs with nobody subscribed
    (a fresh hub for each measurement, alternating)."""
    ns_id = bytes(16)  # no namespace given: the hub publishes placeholders, as for an unknown one
    events = [StoreEvent(EventKind.STORED, Tier.HOST, ns_id, i.to_bytes(32, "big"), None, 32) for i in range(500)]
    probe = [StoreEvent(EventKind.REMOVED, Tier.GPU, ns_id, bytes(32), None, 32)]

    def calls(stuck: bool) -> list[float]:
        hub = EventHub(EventsConfig(endpoint="tcp://127.0.0.1:*", topic=TOPIC, hwm=1, buffer_steps=64))
        sub = zctx.socket(zmq.SUB)
        try:
            (endpoint,) = hub.start()
            if stuck:
                sub.setsockopt(zmq.RCVHWM, 1)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(endpoint)
                deadline = time.monotonic() + 30.0
                while not sub.poll(50):  # joined once a probe arrives (the slow-joiner rule); then it never reads
                    if time.monotonic() > deadline:
                        raise RuntimeError("events: the stuck subscriber never joined")
                    hub.publish(probe, {})
            out = []
            for _ in range(STUCK_PUBLISHES):
                t0 = time.perf_counter()
                hub.publish(events, {})
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        finally:
            hub.close()
            sub.close(linger=0)

    progress(f"events: publish calls beside a subscriber that never reads, {reps} repetitions")
    stuck: list[list[float]] = []
    alone: list[list[float]] = []
    for _ in range(reps):
        stuck.append(calls(True))
        alone.append(calls(False))
    case = f"publish of 500 events beside a subscriber that never reads (PUB hwm 1, {STUCK_PUBLISHES} calls)"
    return [latency_row(case, metric, "ms", Samples([f(c) for c in stuck]), "same calls, nobody subscribed",
                        Samples([f(c) for c in alone]))
            for metric, f in (("p99 call", lambda c: quantile(c, 0.99)), ("slowest call", max))]


def _unpack(buf: bytes) -> object:
    """The floor of decoding: msgpack alone, no checks, no event objects."""
    return msgpack.unpackb(buf, raw=False)


def _decode_packed(buf: bytes) -> object:
    return decode_batch(buf, packed=True)


def _decoder(batches: list[bytes], events: int, decode: Callable[[bytes], object]) -> Callable[[], float]:
    def once() -> float:
        with Timer() as t:
            for buf in batches:
                decode(buf)
        return events / t.seconds
    return once


def _record(conn: Connection, kind: str, start: float, pub_s: float, events: int, expected: int,
            published: dict[str, list[float]], received: dict[str, list[float]]) -> float:
    # kind: the measurement's key in published / received
    """Store the published and received rates of one measurement (the first is alternate_many()'s
    warm-up); raise if the subscriber missed anything."""
    reply = conn.recv()
    got, last, errors = reply[1], reply[2], reply[3]
    if got != expected or errors:
        raise RuntimeError(f"events: the {kind} subscriber got {got} of {expected} "
                           f"({errors} undecodable); messages were lost")
    published[kind].append(events / pub_s)
    received[kind].append(events / (last - start))
    return received[kind][-1]


def _expect(conn: Connection, what: str, timeout_s: float) -> None:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"events: the subscriber process did not answer {what!r} within {timeout_s:.0f} s")
    reply = conn.recv()
    if reply != what:
        raise RuntimeError(f"events: the subscriber answered {reply!r}, expected {what!r}")


def _probe(conn: Connection, name: str, send: Callable[[], object]) -> None:
    """Send probes until the subscriber has seen one: a SUB socket only receives what is sent
    after its subscription reached the publisher (ZMQ's slow-joiner rule)."""
    conn.send(("probe", name))
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        send()
        if conn.poll(0.02):
            _expect(conn, "ready", 1.0)
            return
    raise RuntimeError(f"events: the subscriber never received the {name} publisher's probes")


# --- the subscriber process --------------------------------------------------------------------


def _subscriber(conn: Connection, endpoints: dict[str, str]) -> None:
    """SUB sockets on both publishers; answers ``probe`` and ``measure`` commands until ``stop``."""
    ctx = zmq.Context()
    socks: dict[str, zmq.Socket] = {}
    for name, endpoint in endpoints.items():
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, 0)  # the bench measures speed, not loss: never drop on this side
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(endpoint)
        socks[name] = s
    conn.send("connected")
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            sock = socks[cmd[1]]
            if cmd[0] == "probe":
                sock.recv_multipart()
                time.sleep(0.05)
                _drain(sock)
                conn.send("ready")
            elif cmd[0] == "measure":
                conn.send("armed")
                if cmd[1] == "raw":
                    got, last, errors = _count_raw(sock, cmd[2])
                else:
                    got, last, errors = _count_events(sock, cmd[2], packed=cmd[1] == "packed")
                conn.send(("done", got, last, errors))
    finally:
        for s in socks.values():
            s.close(linger=0)
        ctx.term()


def _drain(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return


def _count_events(sock: zmq.Socket, expected: int, packed: bool) -> tuple[int, float, int]:
    """Decode batches until ``expected`` block hashes of the workload (CPU medium) have arrived
    (``packed``: the packed publisher's batches, SPEC.md §9.8)."""
    got = errors = 0
    last = time.monotonic()
    while got < expected and sock.poll(IDLE_TIMEOUT_S * 1000):
        frames = sock.recv_multipart(copy=True)
        try:
            batch = decode_batch(frames[2], packed=packed)
        except KVTierError:  # the decoder's only errors; counted, and the parent fails the run
            errors += 1
            continue
        got += sum(len(e.block_hashes) for e in batch.events if getattr(e, "medium", None) == "CPU")
        last = time.monotonic()
    return got, last, errors


def _count_raw(sock: zmq.Socket, expected: int) -> tuple[int, float, int]:
    """Receive ``expected`` workload messages (probes skipped) without decoding them."""
    got = 0
    last = time.monotonic()
    while got < expected and sock.poll(IDLE_TIMEOUT_S * 1000):
        frames = sock.recv_multipart(copy=False)
        if frames[1].bytes != PROBE_SEQ:
            got += 1
        last = time.monotonic()
    return got, last, 0


__all__ = ["DESCRIPTION", "Workload", "add_arguments", "run"]
