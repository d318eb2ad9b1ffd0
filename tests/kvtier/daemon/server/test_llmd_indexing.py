"""llm-d indexes a real kvtier daemon's KV events unmodified (engine-interfaces.md §4.5).

A ``kvtier serve`` subprocess publishes on ZMQ under ``kv@pod-a@tiny``; the test plays llm-d
(llmdkit): it subscribes with the ``kv@`` filter, fills sequence gaps through the replay socket,
recomputes its own FNV/CBOR request keys from each event's ``token_ids``, and must then find every
stored block in the tier where the daemon holds it: ``cpu`` on save, ``storage`` after a demotion
(``+cpu``, ``+storage``, ``-cpu`` in that order), and nowhere after a delete or a clear.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kvtier.client import Client
from kvtier_protocol.keys import block_keys, chain_hashes
from kvtier_protocol.namespace import Namespace
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.daemon.server.llmdkit import LlmdIndexer

POD, MODEL = "pod-a", "tiny"
# 32 tokens per block in two 16-token hash units: llm-d's 16-token request keys map 1:1 onto units.
NS = Namespace(model=MODEL, revision="r1", attention="mha", num_layers=1, num_kv_heads=1, head_dim=32,
               kv_dtype="float16", block_tokens=32, hash_tokens=16)
TIER = {"host": "cpu", "disk": "storage"}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[KvtierDaemon]:
    d = KvtierDaemon(tmp_path, host_bytes="96KiB", extra_args=(
        "--events", "tcp://127.0.0.1:*", "--replay", "tcp://127.0.0.1:*", "--topic", f"kv@{POD}@{MODEL}"))
    try:
        d.start()
        yield d
    finally:
        d.cleanup()


class Llmd:
    """llm-d's subscriber: a SUB on the live feed and a DEALER for replay, feeding an indexer."""

    def __init__(self, daemon: KvtierDaemon) -> None:
        log = daemon.log()
        live = re.findall(r"kvtierd events (\S+)", log)[-1]
        replay = re.findall(r"kvtierd replay (\S+)", log)[-1]
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(live)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.idx = LlmdIndexer()

    def drain(self, until: Callable[[], bool], timeout_s: float = 15.0) -> None:
        """Apply messages (replaying any gap, as llm-d does) until ``until()`` holds."""
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, "llm-d did not see the expected events in time"
            if not self.sub.poll(100):
                continue
            frames = self.sub.recv_multipart()
            seq = int.from_bytes(frames[1][:8], "big")
            expected = 0 if self.idx.last_seq is None else self.idx.last_seq + 1
            if seq > expected:
                self._replay(expected)  # missed (e.g. before the subscription took): ask for them
            if seq == (0 if self.idx.last_seq is None else self.idx.last_seq + 1):
                self.idx.feed(frames)

    def _replay(self, start: int) -> None:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert self.dealer.poll(5000), "no replay answer"
            frames = self.dealer.recv_multipart()[1:]  # drop the empty delimiter, as llm-d does
            if not frames[2]:
                return  # the end marker
            if int.from_bytes(frames[1], "big") >= start:
                self.idx.feed(frames)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()


def save(client: Client, ids: list[int], *, skip: int = 0, units: bool = True) -> list[bytes]:
    """Save the blocks of ``ids`` after the first ``skip`` (already stored); returns every block's key."""
    unit = chain_hashes(ids, NS.hash_tokens, scheme=NS.hash_scheme)
    keys = block_keys(unit, NS.units_per_block)
    new = keys[skip:]
    tensors = [torch.randn(1, 2, 1, 32, 32).to(torch.float16) for _ in new]
    parents = [keys[i - 1] if i else None for i in range(skip, len(keys))]
    per_block = [ids[i * 32:(i + 1) * 32] for i in range(skip, len(keys))]
    unit_lists = [unit[2 * i:2 * i + 2] for i in range(skip, len(keys))] if units else None
    assert client.save_tensors(NS, new, tensors, parents=parents, tokens=per_block,
                               unit_hashes=unit_lists) == ["stored"] * len(new)
    return keys


def daemon_tiers(client: Client, keys: list[bytes]) -> list[str]:
    """Where the daemon holds each key (llm-d's tier names); stops at the first miss."""
    return [TIER[t] for t in client.lookup(NS.ns_id, keys).tiers]


def test_llmd_finds_every_block_in_its_tier_and_applies_every_removal(daemon: KvtierDaemon) -> None:
    llmd = Llmd(daemon)
    prompts: list[tuple[list[int], list[bytes]]] = []
    try:
        with Client(daemon.address) as client:
            a = tokens(4 * 32, seed=1)
            prompts.append((a, save(client, a)))
            b = a[:2 * 32] + tokens(3 * 32, seed=2)  # shares A's first two blocks
            prompts.append((b, save(client, b, skip=2)))
            c = tokens(2 * 32, seed=3)
            prompts.append((c, save(client, c, units=False)))  # unit digests recomputed by the daemon

            def indexed() -> bool:
                return all(len(llmd.idx.lookup(ids, MODEL, POD)) == 2 * len(keys) for ids, keys in prompts)
            llmd.drain(indexed)
            assert llmd.idx.dropped == 0
            for ids, keys in prompts:  # each block in exactly the tier the daemon holds it in
                want = [t for t in daemon_tiers(client, keys) for _ in range(2)]
                assert [s for s in llmd.idx.lookup(ids, MODEL, POD)] == [{t} for t in want]

            # More prompts than the host tier holds: the least recent blocks go down to disk.
            seed = 10
            while "storage" not in daemon_tiers(client, prompts[0][1]):
                ids = tokens(2 * 32, seed=seed)
                prompts.append((ids, save(client, ids)))
                seed += 1
                assert seed < 60, "the host tier never demoted a block"

            def matches() -> bool:
                return all([s for s in llmd.idx.lookup(ids, MODEL, POD)]
                           == [{t} for t in daemon_tiers(client, keys) for _ in range(2)]
                           for ids, keys in prompts)
            llmd.drain(matches)
            assert llmd.idx.dropped == 0
            demoted = [k for k in llmd.idx.keys(a, MODEL)[:2]]
            assert all(llmd.idx.history[k] == ["+cpu", "+storage", "-cpu"] for k in demoted)

            # A delete removes B's own blocks from every tier; A's shared blocks stay.
            b_keys = prompts[1][1]
            assert client.delete(NS.ns_id, b_keys[2:]) == 3
            llmd.drain(lambda: len(llmd.idx.lookup(b, MODEL, POD)) == 4)
            assert len(llmd.idx.lookup(a, MODEL, POD)) == 8

            # A clear removes everything: llm-d is left holding nothing for this pod.
            client.clear(NS.ns_id)
            llmd.drain(lambda: all(not llmd.idx.lookup(ids, MODEL, POD) for ids, _ in prompts))
            assert all(not pods for tiers in llmd.idx.index.values() for pods in tiers.values())
            assert all(h[-1].startswith("-") for h in llmd.idx.history.values())
    finally:
        llmd.close()
