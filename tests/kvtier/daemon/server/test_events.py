"""EventHub: vLLM 0.33 KV events over real ZMQ sockets, fed by a real TieredStore.

A real SUB socket reads what the hub publishes and decodes it with plain msgpack; a DEALER asks
the replay ROUTER for missed batches; a small llm-d-like indexer (recomputes every hash from
``token_ids`` and the parent, drops events whose parent it has not seen) checks that stores,
demotions and removals index exactly what the store holds.
"""

from __future__ import annotations

import os
import random
import time
from array import array
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial

import msgpack
import pytest
import zmq
from kvtier_protocol.errors import EventError, InvalidRequest, Unavailable
from kvtier_protocol.events import (BlockRemoved, BlockStored, Event, EventBatch, decode_batch, encode_batch,
                                    event_to_wire, parse_live_message, parse_replay_reply, replay_request)
from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum
from kvtier_protocol.keys import block_keys, chain_hashes, event_hash
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.config import EventsConfig
from kvtier.daemon.server import event_translate
from kvtier.daemon.server.event_translate import BlockTokens, EventTranslator, Translated
from kvtier.daemon.server.event_zmq import WireBatch, ZmqPublisher
from kvtier.daemon.server.events import EventHub, default_topic, endpoint_binds
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.stats import EventKind, StoreEvent
from kvtier.daemon.store.store import TieredStore
from kvtier.daemon.store.types import Tier
from tests.kvtier.waitkit import PATIENCE_S, wait_until

NS = Namespace(model="m", revision="r", attention="mha", num_layers=1, num_kv_heads=1, head_dim=32,
               kv_dtype="float16", block_tokens=32, hash_tokens=16)  # two hash units per block
BLOCK = NS.block_payload_bytes()  # 4096
TOPIC = "kv@pod-1@m"


def events_config(**overrides: object) -> EventsConfig:
    """The daemon's events config, publishing on a free loopback port under TOPIC by default."""
    values: dict[str, object] = {"endpoint": "tcp://127.0.0.1:*", "topic": TOPIC}
    values.update(overrides)
    return EventsConfig(**values)


class Recorder:
    """A metrics sink implementing ``event_published``."""

    def __init__(self) -> None:
        self.published = 0

    def event_published(self, n: int = 1) -> None:
        self.published += n


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def hubs() -> Iterator[list[EventHub]]:
    made: list[EventHub] = []
    yield made
    for hub in made:
        hub.close()


def started(hubs: list[EventHub], settings: EventsConfig, **kwargs: object) -> EventHub:
    hub = EventHub(settings, **kwargs)  # type: ignore[arg-type]
    hubs.append(hub)
    hub.start()
    return hub


PROBE = StoreEvent(EventKind.REMOVED, Tier.HOST, NS.ns_id, b"\xee" * 32, None, 32)
"""What a hub publishes to find out that a subscriber has joined: the removal of a block nobody
stored (a placeholder BlockRemoved; the translator keeps nothing of it)."""


def joined(sub: zmq.Socket, send: Callable[[], object], first_seq: int = 0) -> int:
    """Wait until ``sub``'s subscription has reached the publisher, and return the probes sent.

    A PUB socket drops what it sends before a subscriber's subscription arrives (ZMQ's slow
    joiner), and nothing tells when that is: so ``send()`` publishes one probe batch (seq
    ``first_seq``, then the next ...) until one arrives; then the probes sent after it are read
    up to the last, which leaves the socket empty for what the test publishes next.
    """
    sent = 0
    deadline = time.monotonic() + PATIENCE_S
    while True:
        send()
        sent += 1
        if sub.poll(50):  # a bound SUB also attaches the PUB's connection only while polled
            break
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
    last = first_seq + sent - 1
    while int.from_bytes(receive(sub, 1, PATIENCE_S)[0][1], "big") != last:
        pass
    return sent


def hub_probe(hub: EventHub) -> Callable[[], object]:
    """:func:`joined`'s ``send`` for a hub: publish :data:`PROBE`."""
    return lambda: hub.publish([PROBE], {}) == 1 or pytest.fail("the hub did not queue a probe")


def subscriber(zctx: zmq.Context, hub: EventHub) -> zmq.Socket:
    """A SUB connected to ``hub``'s PUB endpoint whose subscription the hub has (see :func:`joined`).
    The hub had published nothing before: its probes took seqs 0, 1, ..."""
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(hub.endpoints[0])
    joined(sub, hub_probe(hub))
    return sub


def receive(sock: zmq.Socket, n: int, timeout_s: float = PATIENCE_S) -> list[list[bytes]]:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), f"got {len(out)} of {n} messages"
        out.append(sock.recv_multipart())
    return out


@pytest.fixture
async def store(tmp_path) -> AsyncIterator[TieredStore]:
    """Host tier of four blocks, write-back to disk: the fifth block demotes the oldest."""
    cfg = StoreConfig(host_bytes=4 * BLOCK, host_name_prefix=f"kvtier-ev-{os.getpid()}", host_prefault=False,
                      host_pin=False, disk_path=str(tmp_path / "disk"), disk_bytes=1 << 22)
    s = TieredStore(cfg)
    await s.start()
    s.register_namespace(NS)
    yield s
    await s.close()


def prompt(n_blocks: int, offset: int = 0) -> tuple[list[int], list[bytes], list[bytes]]:
    """Tokens of ``n_blocks`` blocks, their unit digests and their block keys."""
    tokens = [offset + i for i in range(n_blocks * NS.block_tokens)]
    units = chain_hashes(tokens, NS.hash_tokens)
    return tokens, units, block_keys(units, NS.units_per_block)


async def put_prompt(store: TieredStore, hub: EventHub, n_blocks: int, *, offset: int = 0,
                     with_units: bool = True) -> tuple[list[int], list[bytes], list[bytes]]:
    """Store every block of a prompt (reserve, write, commit) and note its tokens, as the data
    plane does."""
    tokens, units, keys = prompt(n_blocks, offset)
    ns_id = NS.ns_id
    res = await store.reserve(ns_id, keys, [BLOCK] * len(keys))
    headers = []
    for b, (key, slot) in enumerate(zip(keys, res.slots)):
        payload = bytes([b + offset & 0xFF]) * BLOCK
        store.host.view(slot)[:] = payload
        h = BlockHeader(ns_id=ns_id, chain_hash=key, parent_hash=keys[b - 1] if b else None,
                        num_tokens=NS.block_tokens, layout="canonical", shape=(1, 2, 1, NS.block_tokens, 32),
                        dtype="float16", codec="raw", sections=(Section("payload", 0, BLOCK),),
                        payload_len=BLOCK, checksum=payload_checksum(payload))
        headers.append(encode_header(h))
    assert all(await store.commit(res.lease_id, headers))
    upb = NS.units_per_block
    hub.note_blocks(ns_id, [BlockTokens(key, keys[b - 1] if b else None,
                                        tuple(tokens[b * NS.block_tokens:(b + 1) * NS.block_tokens]),
                                        tuple(units[b * upb:(b + 1) * upb]) if with_units else ())
                            for b, key in enumerate(keys)])
    return tokens, units, keys


def pump(store: TieredStore, hub: EventHub) -> int:
    return hub.publish(store.take_events(), {ns.ns_id: ns for ns in store.namespaces()})


class Indexer:
    """What llm-d does with events: recompute keys from token ids (here with vLLM's own chain,
    so they must equal the published u64s), index by medium, apply placeholders and removals."""

    def __init__(self) -> None:
        self.digest: dict[int, tuple[bytes, int]] = {}  # u64 -> (digest, tokens before its end)
        self.where: dict[int, list[str]] = {}  # u64 -> media, in the order they arrived
        self.history: dict[int, list[str]] = {}  # u64 -> "+CPU", "-CPU", ... as applied
        self.dropped = 0

    def apply(self, batch: list) -> None:
        for ev in batch[1]:
            if ev["type"] == "BlockStored" and ev["token_ids"]:
                self._stored(ev)
            elif ev["type"] == "BlockStored":  # placeholder: only updates known hashes
                for h in ev["block_hashes"]:
                    if h in self.digest:
                        self._add(h, ev["medium"])
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    self.where[h].remove(ev["medium"])
                    self.history[h].append("-" + ev["medium"])

    def _add(self, h: int, medium: str) -> None:
        self.where.setdefault(h, []).append(medium)
        self.history.setdefault(h, []).append("+" + medium)

    def _stored(self, ev: dict) -> None:
        assert len(ev["token_ids"]) == len(ev["block_hashes"]) * ev["block_size"]
        assert ev["group_idx"] == 0 and ev["kv_cache_spec_kind"] == "full_attention"
        parent = ev["parent_block_hash"]
        if parent is not None and parent not in self.digest:
            self.dropped += 1  # llm-d drops an event whose parent it has not seen
            return
        if parent is None:
            digests, pos = chain_hashes(ev["token_ids"], ev["block_size"]), 0
        else:
            pdigest, pos = self.digest[parent]
            digests = chain_hashes(ev["token_ids"], ev["block_size"], parent=pdigest, start=pos)
        assert [event_hash(d) for d in digests] == ev["block_hashes"]
        for i, (h, d) in enumerate(zip(ev["block_hashes"], digests)):
            self.digest[h] = (d, pos + (i + 1) * ev["block_size"])
            self._add(h, ev["medium"])


# --- ZMQ transport --------------------------------------------------------------------------


async def test_sub_receives_vllm_map_batches_with_seq_from_zero(store, hubs, zctx) -> None:
    metrics = Recorder()
    hub = started(hubs, events_config(), metrics=metrics)
    assert hub.endpoints[0].startswith("tcp://127.0.0.1:") and "*" not in hub.endpoints[0]
    sub = subscriber(zctx, hub)
    probes = metrics.published  # the probe batches joined() published: seqs 0 .. probes - 1
    # The sender thread counts a batch after handing it to ZMQ, so the SUB may see it first.
    wait_until(lambda: hub.zmq_stats.batches_sent == probes, what="the sender counting every probe it sent")
    _, units, keys = await put_prompt(store, hub, 2)
    assert pump(store, hub) == 1  # two blocks of one chain in one medium: one BlockStored run
    await store.delete(NS.ns_id, [keys[1]])
    assert pump(store, hub) == 1
    assert metrics.published == probes + 2
    msgs = receive(sub, 2)
    assert [len(m) for m in msgs] == [3, 3]
    assert [m[0] for m in msgs] == [TOPIC.encode()] * 2
    assert [int.from_bytes(m[1], "big") for m in msgs] == [probes, probes + 1] and all(len(m[1]) == 8 for m in msgs)
    first, second = (msgpack.unpackb(m[2], raw=False) for m in msgs)
    assert len(first) == 3 and isinstance(first[0], float) and first[2] == 0
    (stored,) = first[1]
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                            "lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind"]
    assert stored == {"type": "BlockStored", "block_hashes": [event_hash(u) for u in units],
                      "parent_block_hash": None, "token_ids": list(range(64)), "block_size": 16,
                      "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0,
                      "kv_cache_spec_kind": "full_attention"}
    assert second[1] == [{"type": "BlockRemoved", "block_hashes": [event_hash(u) for u in units[2:]],
                          "medium": "CPU", "group_idx": 0}]
    assert decode_batch(msgs[0][2]).events[0] == BlockStored(
        tuple(event_hash(u) for u in units), None, tuple(range(64)), 16, medium="CPU", group_idx=0,
        kv_cache_spec_kind="full_attention")
    sub.close(linger=0)


async def test_replay_returns_missed_batches_then_the_end_marker(store, hubs, zctx) -> None:
    hub = started(hubs, events_config(replay_endpoint="tcp://127.0.0.1:*", buffer_steps=2))
    for i in range(3):  # nobody subscribed: all three are missed
        await put_prompt(store, hub, 1, offset=1000 * i)
        assert pump(store, hub) == 1
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(hub.endpoints[1])
    dealer.send_multipart([b"no", b"t", b"valid"])  # the ROUTER ignores a malformed request
    dealer.send_multipart(replay_request(0))  # seq 0 left the two-batch buffer
    replies = [parse_replay_reply(f) for f in receive(dealer, 3)]
    assert [r.seq for r in replies[:2]] == [1, 2] and replies[2] is None
    assert {r.topic for r in replies[:2]} == {TOPIC}
    assert decode_batch(replies[1].payload).events[0].token_ids == tuple(range(2000, 2032))
    dealer.send_multipart(replay_request(2))
    assert [parse_replay_reply(f) for f in receive(dealer, 2)][1] is None
    dealer.send_multipart(replay_request(7))  # nothing that new: only the end marker
    (end,) = receive(dealer, 1)
    assert end == [b"", b"", b"\xff" * 8, b""]  # delimiter, empty topic, seq -1, empty payload
    assert hub.zmq_stats.replay_bad == 1 and hub.zmq_stats.replay_requests == 3
    dealer.close(linger=0)


async def test_legacy_switch_encodes_events_as_arrays(store, hubs, zctx) -> None:
    hub = started(hubs, events_config(legacy_array=True))
    sub = subscriber(zctx, hub)
    _, units, _ = await put_prompt(store, hub, 1)
    pump(store, hub)
    (msg,) = receive(sub, 1)
    batch = msgpack.unpackb(msg[2], raw=False)
    assert batch[1] == [["BlockStored", [event_hash(u) for u in units], None, list(range(32)), 16,
                         None, "CPU", None, None, 0, "full_attention"]]
    sub.close(linger=0)


def test_connects_to_a_subscriber_that_binds(hubs, zctx) -> None:
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    hub = started(hubs, events_config(endpoint=f"tcp://localhost:{port}"))  # a name: connect, like vLLM
    assert hub.endpoints == [f"tcp://localhost:{port}"]
    # A bound SUB attaches a new peer (and sends it the subscription) only when its own thread
    # calls into it: joined polls while the hub's PUB connects.
    probes = joined(sub, hub_probe(hub))
    ev = StoreEvent(EventKind.STORED, Tier.DISK, NS.ns_id, bytes(range(32)), None, 32)
    assert hub.publish([ev], {}) == 1
    (msg,) = receive(sub, 1)
    assert int.from_bytes(msg[1], "big") == probes
    (stored,) = msgpack.unpackb(msg[2], raw=False)[1]
    assert stored["medium"] == "STORAGE" and stored["block_hashes"] == [event_hash(bytes(range(32)))]
    sub.close(linger=0)


def test_endpoint_rule() -> None:
    for ep in ("tcp://*:5557", "tcp://[::1]:5557", "ipc:///tmp/x", "inproc://x", "tcp://127.0.0.1:5557",
               "tcp://127.0.0.2:1"):
        assert endpoint_binds(ep), ep
    for ep in ("tcp://10.0.0.7:5557", "tcp://localhost:5557", "tcp://router.example:5557"):
        assert not endpoint_binds(ep), ep


async def test_publish_never_blocks_without_or_with_a_stuck_subscriber(hubs, zctx, tmp_path) -> None:
    hub = started(hubs, events_config(endpoint=f"ipc://{tmp_path}/ev.sock", hwm=1))
    stuck = zctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    big = [StoreEvent(EventKind.STORED, Tier.HOST, NS.ns_id, i.to_bytes(32, "big"), None, 32) for i in range(500)]

    def publish() -> None:
        assert hub.publish(big, {}) == 1  # returned: queued for the sender thread, never waiting on it

    # How long a publish takes beside a stuck subscriber is a figure of the machine, not a test:
    # here publish must return (this test would hang otherwise) and the counters must add up.
    for _ in range(50):  # no subscriber yet
        publish()
    # Let the sender thread hand those 50 to PUB (which drops them: nobody listens) before the
    # subscriber arrives; otherwise a batch still queued would reach it.
    wait_until(lambda: hub.zmq_stats.batches_sent + hub.zmq_stats.send_dropped >= 50, what="50 batches handed to PUB")
    assert hub.zmq_stats.batches_sent + hub.zmq_stats.send_dropped == 50
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(hub.endpoints[0])
    probes = joined(stuck, hub_probe(hub), first_seq=50)  # subscribed; from now on it never reads
    for _ in range(100):  # ~2 MB more than the socket buffers hold
        publish()
    hub.close()  # the sender thread finishes too: PUB dropped what the subscriber did not take
    stats = hub.zmq_stats
    assert stats.batches_sent + stats.send_dropped == 150 + probes and stats.queue_dropped == 0
    stuck.close(linger=0)


def test_lifecycle_and_endpoint_errors(hubs, zctx) -> None:
    ev = [StoreEvent(EventKind.STORED, Tier.HOST, NS.ns_id, bytes(range(32)), None, 32)]
    hub = EventHub(events_config())
    hubs.append(hub)
    q = hub.subscribe()
    assert hub.publish(ev, {}) == 0 and q.qsize() == 1  # not started: SSE only
    assert hub.publish([], {}) == 0
    hub.start()
    assert hub.publish(ev, {}) == 1
    hub.close()
    hub.close()
    assert hub.publish(ev, {}) == 0 and q.qsize() == 3
    assert hub.zmq_stats.batches_sent == 1
    with pytest.raises(InvalidRequest):
        EventHub(events_config(endpoint=None, replay_endpoint="tcp://127.0.0.1:*"))
    with pytest.raises(InvalidRequest):
        started(hubs, events_config(endpoint="tcp://127.0.0.1:notaport"))
    taken = zctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(Unavailable):
        started(hubs, events_config(endpoint=f"tcp://127.0.0.1:{port}"))
    with pytest.raises(Unavailable):
        started(hubs, events_config(replay_endpoint=f"tcp://127.0.0.1:{port}"))
    taken.close(linger=0)
    assert default_topic().startswith("kv@") and default_topic().endswith("@kvtier")
    assert EventHub(events_config(endpoint=None, topic="")).topic == default_topic()


# --- what an llm-d indexer sees ---------------------------------------------------------------


async def test_llmd_indexes_stores_demotions_and_removals(store, hubs, zctx) -> None:
    hub = started(hubs, events_config())
    sub = subscriber(zctx, hub)
    idx = Indexer()
    _, units_a, keys_a = await put_prompt(store, hub, 3)  # digests given by the client
    _, units_b, keys_b = await put_prompt(store, hub, 2, offset=5000, with_units=False)  # recomputed
    n = pump(store, hub)
    # A fifth block overflows the four-block host tier: the least recent ones go down to disk.
    _, units_c, keys_c = await put_prompt(store, hub, 1, offset=9000)
    n += pump(store, hub)
    for frames in receive(sub, 2):
        idx.apply(msgpack.unpackb(parse_live_message(frames).payload, raw=False))
    assert idx.dropped == 0
    units = {k: units_a[2 * i:2 * i + 2] for i, k in enumerate(keys_a)}
    units |= {k: units_b[2 * i:2 * i + 2] for i, k in enumerate(keys_b)}
    units[keys_c[0]] = units_c
    for info in store.iter_blocks(NS.ns_id):
        media = sorted(t.medium for t in info.tiers)
        for u in units[info.chain_hash]:
            assert sorted(idx.where[event_hash(u)]) == media
    demoted = [k for k in units if Tier.HOST not in store.info(NS.ns_id, k).tiers]
    assert demoted == keys_a[:2]  # the two least recent blocks went down to disk (write-back)
    for k in demoted:  # in tier order: CPU, then STORAGE, then CPU left
        assert [idx.history[event_hash(u)] for u in units[k]] == [["+CPU", "+STORAGE", "-CPU"]] * 2
    await store.clear(NS.ns_id)
    pump(store, hub)
    for frames in receive(sub, 1):
        batch = msgpack.unpackb(parse_live_message(frames).payload, raw=False)
        assert {e["type"] for e in batch[1]} == {"BlockRemoved"}  # never AllBlocksCleared
        idx.apply(batch)
    assert all(not media for media in idx.where.values())
    assert hub.token_info_blocks == 0  # every block left every tier: token info forgotten
    # Merged runs: (A0-A2 stored, A0 to STORAGE, A0 off CPU, B0-B1 stored) + (A1 to STORAGE,
    # A1 off CPU, C0 stored).
    assert n == 4 + 3
    sub.close(linger=0)


def test_demotion_order_within_one_batch() -> None:
    """A move is STORED in the destination before REMOVED from the source, and stays so."""
    tr = EventTranslator()
    _, units, keys = prompt(1)
    tr.note_blocks(NS.ns_id, [BlockTokens(keys[0], None, tuple(range(32)), tuple(units))])
    evs = [StoreEvent(kind, tier, NS.ns_id, keys[0], None, 32)
           for kind, tier in ((EventKind.STORED, Tier.HOST), (EventKind.STORED, Tier.DISK),
                              (EventKind.REMOVED, Tier.HOST))]
    out = reference_merge(tr.translate(evs, {NS.ns_id: NS}))
    assert [(type(e).__name__, e.medium) for e in out] == [("BlockStored", "CPU"), ("BlockStored", "STORAGE"),
                                                          ("BlockRemoved", "CPU")]
    assert out[1].token_ids == tuple(range(32)) and out[2].block_hashes == tuple(event_hash(u) for u in units)
    assert len(tr) == 1  # still on disk
    tr.translate([StoreEvent(EventKind.REMOVED, Tier.DISK, NS.ns_id, keys[0], None, 32)], {})
    assert len(tr) == 0


# --- translation edge cases ---------------------------------------------------------------------


def test_placeholder_without_token_info() -> None:
    key = bytes(range(32))
    (t,) = EventTranslator().translate([StoreEvent(EventKind.STORED, Tier.HOST, NS.ns_id, key, bytes(32), 32)],
                                       {NS.ns_id: NS})
    assert t.event == BlockStored((event_hash(key),), None, (), 0, medium="CPU", group_idx=0,
                                  kv_cache_spec_kind="full_attention")


def test_inconsistent_token_info_falls_back_to_placeholders() -> None:
    tr = EventTranslator()
    _, units, keys = prompt(2)
    tr.note_blocks(NS.ns_id, [
        BlockTokens(keys[0], None, tuple(range(32)), (units[1], units[0])),  # last unit is not the key
        BlockTokens(keys[1], keys[0], (), ()),  # no tokens
        BlockTokens(keys[1], keys[0], (-1,) * 32),  # not token ids
    ])
    assert tr.invalid_notes == 3 and len(tr) == 0
    tr.note_blocks(NS.ns_id, [BlockTokens(keys[1], keys[0], tuple(range(100, 132)))])  # wrong tokens
    (t,) = tr.translate([StoreEvent(EventKind.STORED, Tier.HOST, NS.ns_id, keys[1], keys[0], 32)], {NS.ns_id: NS})
    assert not t.full and len(tr) == 0  # recomputed digests did not reach the key: dropped


@pytest.mark.parametrize("big", [False, True])
def test_token_ids_noted_as_an_array_publish_as_a_tuple_does(big: bool) -> None:
    """A data plane may hand token ids as an ``array('I')`` (copied without an int per id) or
    ``array('Q')`` (an id above 32 bits): the same runs as from tuples, in both wire forms."""
    tokens, units, keys = prompt(3, offset=(1 << 33) if big else 0)
    events = [StoreEvent(EventKind.STORED, Tier.HOST, NS.ns_id, k, keys[b - 1] if b else None, 32)
              for b, k in enumerate(keys)]
    out = []
    for form in (tuple, partial(array, "Q" if big else "I")):
        tr = EventTranslator()
        tr.note_blocks(NS.ns_id, [BlockTokens(k, keys[b - 1] if b else None, form(tokens[b * 32:b * 32 + 32]),
                                              tuple(units[2 * b:2 * b + 2])) for b, k in enumerate(keys)])
        assert tr.invalid_notes == 0
        runs = tr.translate_runs(events, {NS.ns_id: NS})
        out.append(([r.wire() for r in runs], [r.packed() for r in runs]))
    assert out[0] == out[1]
    assert out[0][0][0]["token_ids"] == tokens  # one run of the three blocks


def test_one_unit_per_block_and_unknown_namespace() -> None:
    tr = EventTranslator()
    tokens = list(range(16))
    (key,) = chain_hashes(tokens, 16)
    tr.note_blocks(NS.ns_id, [BlockTokens(key, None, tuple(tokens))])
    (t,) = tr.translate([StoreEvent(EventKind.STORED, Tier.HOST, NS.ns_id, key, None, 16)], {})
    assert t.event.block_hashes == (2233398808101521225,) and t.event.block_size == 16  # SPEC.md §3.4


def test_mla_namespace_kind_and_run_merging() -> None:
    mla = Namespace(model="m", revision="r", attention="mla", num_layers=1, num_kv_heads=1, head_dim=32,
                    head_dim_v=0, kv_dtype="float16", block_tokens=16, hash_tokens=16)
    tokens = list(range(48))
    keys = chain_hashes(tokens, 16, extras=mla.extra_keys())
    tr = EventTranslator()
    tr.note_blocks(mla.ns_id, [BlockTokens(k, None, tuple(tokens[16 * i:16 * i + 16])) for i, k in enumerate(keys)])
    evs = [StoreEvent(EventKind.STORED, Tier.HOST, mla.ns_id, k, keys[i - 1] if i else None, 16)
           for i, k in enumerate(keys)]
    evs.append(StoreEvent(EventKind.STORED, Tier.HOST, mla.ns_id, bytes(32), None, 16))  # placeholder
    (run, ph) = reference_merge(tr.translate(evs, {mla.ns_id: mla}))
    assert run.kv_cache_spec_kind == "mla_attention" and run.token_ids == tuple(tokens)
    assert run.block_hashes == tuple(event_hash(k) for k in keys) and ph.token_ids == ()


def test_token_info_lru_is_bounded() -> None:
    tr = EventTranslator(max_blocks=2, max_tokens=1 << 20)
    keys = chain_hashes(list(range(64)), 16)
    tr.note_blocks(NS.ns_id, [BlockTokens(k, None, tuple(range(16))) for k in keys])
    assert len(tr) == 2
    tr = EventTranslator(max_blocks=100, max_tokens=40)
    tr.note_blocks(NS.ns_id, [BlockTokens(k, None, tuple(range(16))) for k in keys])
    assert len(tr) == 2


# --- SSE fan-out --------------------------------------------------------------------------------


async def test_sse_subscribers_get_dicts_and_a_full_queue_drops_only_its_own(store, hubs) -> None:
    hub = started(hubs, events_config(endpoint=None))
    assert hub.endpoints == []
    slow, fast = hub.subscribe(maxsize=1), hub.subscribe()
    _, units, keys = await put_prompt(store, hub, 3)
    assert pump(store, hub) == 1
    assert slow.qsize() == 1 and hub.dropped(slow) == 2 and hub.stats.sse_dropped == 2
    got = [fast.get_nowait() for _ in range(fast.qsize())]
    assert [d["chain_hash"] for d in got] == [k.hex() for k in keys]
    d = got[1]
    assert d["type"] == "BlockStored" and d["medium"] == "CPU" and d["tier"] == "host"
    assert d["ns"] == NS.ns_id.hex() and d["parent_hash"] == keys[0].hex() and d["seq"] == 0
    assert d["block_hashes"] == [event_hash(u) for u in units[2:4]]
    assert d["parent_block_hash"] == event_hash(keys[0]) and d["token_ids"] == list(range(32, 64))
    hub.unsubscribe(slow)
    await store.delete(NS.ns_id, keys)
    pump(store, hub)
    assert [fast.get_nowait()["type"] for _ in range(3)] == ["BlockRemoved"] * 3
    assert hub.num_subscribers == 1 and slow.qsize() == 1


# --- the publish path: translate_wire == event_to_wire(reference_merge(translate)) --------------


def _joins(prev: Translated, cur: Translated, tokens: int, hashes: int) -> bool:
    """Whether ``cur`` extends the run ending in ``prev`` into one wire event (the object-level
    rule the daemon used before translate_wire; kept here as the oracle)."""
    a, b = prev.event, cur.event
    if (type(a) is not type(b) or a.medium != b.medium or prev.source.ns_id != cur.source.ns_id
            or hashes + len(b.block_hashes) > event_translate.MAX_RUN_HASHES):
        return False
    if isinstance(a, BlockRemoved):
        return True
    if prev.full != cur.full or a.kv_cache_spec_kind != b.kv_cache_spec_kind:
        return False
    if not cur.full:
        return True  # placeholders only list hashes
    return (a.block_size == b.block_size and cur.source.parent_hash == prev.source.chain_hash
            and tokens + len(b.token_ids) <= event_translate.MAX_RUN_TOKENS)


def reference_merge(translated: list[Translated]) -> list[Event]:
    """Consecutive per-block events joined into runs, object by object."""
    runs: list[list[Translated]] = []
    tokens = hashes = 0
    for t in translated:
        if runs and _joins(runs[-1][-1], t, tokens, hashes):
            runs[-1].append(t)
        else:
            runs.append([t])
            tokens = hashes = 0
        hashes += len(t.event.block_hashes)
        tokens += len(t.event.token_ids) if isinstance(t.event, BlockStored) else 0
    out: list[Event] = []
    for run in runs:
        first = run[0].event
        hashes_ = tuple(h for t in run for h in t.event.block_hashes)
        if isinstance(first, BlockRemoved):
            out.append(BlockRemoved(hashes_, first.medium, first.group_idx))
        else:
            out.append(BlockStored(hashes_, first.parent_block_hash, tuple(x for t in run for x in t.event.token_ids),
                                   first.block_size, medium=first.medium, group_idx=first.group_idx,
                                   kv_cache_spec_kind=first.kv_cache_spec_kind))
    return out


def _scenario(rng: random.Random) -> tuple[list[tuple[bytes, list[BlockTokens]] | list[StoreEvent]],
                                           dict[bytes, Namespace]]:
    """Random notes and store events over three namespaces (two hash units per block, MLA with
    one, one the translator is not told about), with good, unit-less, wrong and malformed notes,
    broken chains, placeholders and repeated tiers."""
    mla = Namespace(model="m", revision="r", attention="mla", num_layers=1, num_kv_heads=1, head_dim=32,
                    head_dim_v=0, kv_dtype="float16", block_tokens=16, hash_tokens=16)
    unknown = Namespace(model="u", revision="r", attention="mha", num_layers=1, num_kv_heads=1, head_dim=32,
                        kv_dtype="float16", block_tokens=16, hash_tokens=16)
    blocks = []  # (ns, tokens, units, key, parent)
    for ns in (NS, mla, unknown):
        tokens = [rng.randrange(1 << (34 if rng.random() < 0.1 else 17)) for _ in range(6 * ns.block_tokens)]
        units = chain_hashes(tokens, ns.hash_tokens, extras=ns.extra_keys())
        keys = block_keys(units, ns.units_per_block)
        upb, bt = ns.units_per_block, ns.block_tokens
        blocks += [(ns, tuple(tokens[i * bt:(i + 1) * bt]), tuple(units[i * upb:(i + 1) * upb]), k,
                    keys[i - 1] if i else None) for i, k in enumerate(keys)]
    steps: list[tuple[bytes, list[BlockTokens]] | list[StoreEvent]] = []
    for _ in range(rng.randrange(1, 8)):
        if rng.random() < 0.4:
            ns = rng.choice((NS, mla, unknown))
            notes = []
            for b_ns, tokens, units, key, parent in blocks:
                if b_ns is not ns or rng.random() < 0.3:
                    continue
                how = rng.random()
                if how < 0.2:
                    units = ()
                elif how < 0.25:
                    tokens = tuple(t + 1 for t in tokens)  # not this block's tokens
                elif how < 0.3:
                    units = units[::-1]  # malformed when there are two
                notes.append(BlockTokens(key, parent, tokens, units))
            steps.append((ns.ns_id, notes))
        else:
            events = []
            for _ in range(rng.randrange(1, 40)):
                b_ns, _, _, key, parent = rng.choice(blocks)
                if rng.random() < 0.1:
                    parent = rng.choice(blocks)[3]
                events.append(StoreEvent(rng.choice((EventKind.STORED, EventKind.STORED, EventKind.REMOVED)),
                                         rng.choice((Tier.HOST, Tier.HOST, Tier.DISK, Tier.GPU)), b_ns.ns_id,
                                         key, parent, b_ns.block_tokens))
            steps.append(events)
    return steps, {NS.ns_id: NS, mla.ns_id: mla}


@pytest.mark.parametrize("limits", [(1 << 14, 1 << 16), (3, 64)])  # (hashes, tokens) per run
def test_translate_wire_equals_the_object_path(limits: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_translate, "MAX_RUN_HASHES", limits[0])
    monkeypatch.setattr(event_translate, "MAX_RUN_TOKENS", limits[1])
    rng = random.Random(7)
    for _ in range(150):
        steps, namespaces = _scenario(rng)
        fast, slow = EventTranslator(max_blocks=12), EventTranslator(max_blocks=12)
        legacy = rng.random() < 0.3
        for step in steps:
            if isinstance(step, tuple):
                fast.note_blocks(*step)
                slow.note_blocks(*step)
                continue
            runs = fast.translate_runs(step, namespaces)
            merged = reference_merge(slow.translate(step, namespaces))
            assert [r.wire(legacy) for r in runs] == [event_to_wire(e, legacy) for e in merged]
            # the packed form (SPEC §9.8) of the same runs, made from their arrays
            assert [r.packed() for r in runs] == [event_to_wire(e, packed=True) for e in merged]
            assert (len(fast), fast._tokens, fast.invalid_notes) == (len(slow), slow._tokens, slow.invalid_notes)


async def test_hub_with_and_without_sse_subscribers_publishes_the_same_bytes(store, hubs, zctx) -> None:
    plain = started(hubs, events_config())
    watched = started(hubs, events_config())
    watched.subscribe(maxsize=100)
    socks = [subscriber(zctx, h) for h in (plain, watched)]
    await put_prompt(store, plain, 3)
    events = store.take_events()
    _, units, keys = prompt(3)
    watched.note_blocks(NS.ns_id, [BlockTokens(k, keys[b - 1] if b else None,
                                               tuple(range(b * 32, b * 32 + 32)), tuple(units[2 * b:2 * b + 2]))
                                   for b, k in enumerate(keys)])
    namespaces = {NS.ns_id: NS}
    try:
        assert plain.publish(events, namespaces) == watched.publish(events, namespaces) == 1
        (a,), (b,) = receive(socks[0], 1), receive(socks[1], 1)
    finally:
        for sock in socks:
            sock.close(linger=0)
    assert msgpack.unpackb(a[2])[1] == msgpack.unpackb(b[2])[1]  # everything but the timestamp
    assert decode_batch(a[2]).events[0].token_ids == tuple(range(96))


@pytest.mark.parametrize("legacy", [False, True])
def test_sender_packs_event_batches_and_wire_batches_alike(zctx, legacy: bool) -> None:
    pub = ZmqPublisher("tcp://127.0.0.1:*", replay_endpoint=None, topic=TOPIC, legacy=legacy, buffer_steps=4,
                       hwm=100, max_queue=10)
    (endpoint,) = pub.start()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(endpoint)
    seqs = iter(range(1 << 30))
    try:
        probes = joined(sub, lambda: pub.submit(next(seqs), EventBatch(0.0, (BlockRemoved((9,), "CPU", 0),), 0)))
        objects = (BlockStored((1, 2), None, (5, 6, 7, 8), 2, medium="CPU", group_idx=0,
                               kv_cache_spec_kind="full_attention"), BlockRemoved((1, 2), "CPU", 0))
        assert pub.submit(probes, EventBatch(3.5, objects, 0))
        assert pub.submit(probes + 1, WireBatch(3.5, [event_to_wire(e, legacy) for e in objects], 0))
        a, b = receive(sub, 2)
    finally:
        sub.close(linger=0)
        pub.close()
    assert a[2] == b[2] == encode_batch(EventBatch(3.5, objects, 0), legacy)
    assert decode_batch(a[2]).events == objects


def _join_all(socks: list[zmq.Socket], send: Callable[[], object]) -> None:
    """:func:`joined` for several SUB sockets fed the same probes: probe until every socket got
    one, then read each up to the last probe sent (all of them see the same seqs)."""
    sent = 0
    deadline = time.monotonic() + PATIENCE_S
    while True:
        send()
        sent += 1
        if all(s.poll(50) for s in socks):
            break
        assert time.monotonic() < deadline, "a subscription never reached the publisher"
    for s in socks:
        while int.from_bytes(receive(s, 1)[0][1], "big") != sent - 1:
            pass


async def test_packed_endpoint_carries_the_same_batches_with_token_ids_packed(store, hubs, zctx) -> None:
    hub = started(hubs, events_config(), packed_endpoint="tcp://127.0.0.1:*")
    assert hub.packed_endpoint is not None and hub.endpoints == [hub.endpoints[0], hub.packed_endpoint]
    socks = []
    for endpoint in hub.endpoints:
        sock = zctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sock.connect(endpoint)
        socks.append(sock)
    try:
        _join_all(socks, hub_probe(hub))
        _, units, keys = await put_prompt(store, hub, 3)
        assert pump(store, hub) == 1
        await store.delete(NS.ns_id, [keys[2]])
        assert pump(store, hub) == 1
        plain, packed = (receive(s, 2) for s in socks)
    finally:
        for sock in socks:
            sock.close(linger=0)
    assert [m[:2] for m in plain] == [m[:2] for m in packed]  # same topic, same seqs
    stored = msgpack.unpackb(packed[0][2])[1][0]
    assert stored["token_ids"] == array("I", range(96)).tobytes()  # little-endian u32s
    assert isinstance(msgpack.unpackb(plain[0][2])[1][0]["token_ids"], list)  # the vLLM stream is unchanged
    with pytest.raises(EventError):
        decode_batch(packed[0][2])  # a decoder not asked for the packed form refuses it
    for a, b in zip(plain, packed):
        vllm, ours = decode_batch(a[2]), decode_batch(b[2], packed=True)
        assert vllm.data_parallel_rank == ours.data_parallel_rank == 0
        assert [(type(e), e.block_hashes, list(getattr(e, "token_ids", ()))) for e in vllm.events] == \
            [(type(e), e.block_hashes, list(getattr(e, "token_ids", ()))) for e in ours.events]
    assert decode_batch(packed[0][2], packed=True).events[0].block_hashes == tuple(event_hash(u) for u in units)
    hub.close()  # the sender threads have counted every batch they sent (they count after the send)
    assert hub.zmq_stats.batches_sent == hub.packed_stats.batches_sent


def test_a_hub_with_only_the_packed_endpoint_counts_what_it_sends(hubs, zctx) -> None:
    hub = started(hubs, events_config(endpoint=None), packed_endpoint="tcp://127.0.0.1:*")
    assert hub.endpoints == [hub.packed_endpoint] and hub.zmq_stats is None
    sock = zctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(hub.packed_endpoint)
    try:
        _join_all([sock], hub_probe(hub))
        hub.note_blocks(NS.ns_id, [BlockTokens(b"\x01" * 32, None, tuple(range(1000, 1032)))])
        stored = StoreEvent(EventKind.STORED, Tier.HOST, NS.ns_id, b"\x01" * 32, None, 32)
        assert hub.publish([stored], {}) == 1  # no namespace: the note's one unit is trusted
        (msg,) = receive(sock, 1)
    finally:
        sock.close(linger=0)
    (event,) = decode_batch(msg[2], packed=True).events
    assert isinstance(event, BlockStored) and event.token_ids == array("I", range(1000, 1032))
    hub.close()
    assert hub.publish([stored], {}) == 0  # the packed sender is the one that counts


def test_packed_publisher_packs_event_batches_and_wire_batches_alike(zctx) -> None:
    with pytest.raises(InvalidRequest):
        ZmqPublisher("tcp://127.0.0.1:*", replay_endpoint=None, topic=TOPIC, legacy=True, buffer_steps=0,
                     hwm=100, max_queue=10, packed=True)
    pub = ZmqPublisher("tcp://127.0.0.1:*", replay_endpoint=None, topic=TOPIC, legacy=False, buffer_steps=0,
                       hwm=100, max_queue=10, packed=True)
    (endpoint,) = pub.start()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(endpoint)
    seqs = iter(range(1 << 30))
    try:
        probes = joined(sub, lambda: pub.submit(next(seqs), EventBatch(0.0, (BlockRemoved((9,), "CPU", 0),), 0)))
        objects = (BlockStored((1, 2), None, (5, 6, 7, 1 << 31), 2, medium="CPU", group_idx=0,
                               kv_cache_spec_kind="full_attention"), BlockRemoved((1, 2), "CPU", 0))
        assert pub.submit(probes, EventBatch(3.5, objects, 0))
        assert pub.submit(probes + 1, WireBatch(3.5, [event_to_wire(e, packed=True) for e in objects], 0))
        a, b = receive(sub, 2)
    finally:
        sub.close(linger=0)
        pub.close()
    assert a[2] == b[2] == encode_batch(EventBatch(3.5, objects, 0), packed=True)
    stored = decode_batch(a[2], packed=True).events[0]
    assert isinstance(stored, BlockStored) and list(stored.token_ids) == [5, 6, 7, 1 << 31]


@pytest.mark.parametrize("length", [8, 12, 16, 32, 64])
@pytest.mark.parametrize("count", [1, 2, 16])
def test_unit_digests_to_u64_equal_event_hash(length: int, count: int) -> None:
    """The note path's C-level conversion (whole-word digests: one array, every last word
    byte-swapped) gives what event_hash gives for each digest."""
    rng = random.Random(length * 100 + count)
    units = tuple(rng.randbytes(length) for _ in range(count))
    assert event_translate._units_u64(units) == array("Q", [event_hash(u) for u in units])
    assert event_translate._units_u64(units[:-1] + (b"short",)) is None
