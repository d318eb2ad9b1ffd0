"""`kvtier selftest`: prove on this machine that the wire contract and the tiers work end to end.

It builds a store on the embedded defaults (host shared memory, the disk tier under a temporary
directory), hashes a prompt with the vLLM-compatible chain, encodes its blocks with the
self-describing header, and checks every promise a user relies on:

1. the vLLM reference hash vector reproduces;
2. blocks put into host memory come back byte-identical through their shared-memory slots;
3. with write-through they are on disk, and after a close and reopen they are found again;
4. a byte flipped on disk is detected and served as a miss, never as data;
5. every codec round-trips a block within its error bound;
6. the clients' bulk copy (``kvtier.client.memcopy``: which one runs here) moves a multi-MiB payload into
   a host slot and out again unchanged.

Exit status 0 when all hold; each check prints one line.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import torch

from kvtier.client import memcopy
from kvtier.daemon.store import StoreConfig, TieredStore
from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.header import split_record
from kvtier_protocol.keys import NONE_HASH, event_hash, hash_block_tokens
from kvtier_protocol.namespace import Namespace

# engine-interfaces.md §3: tokens 0..15 under vllm-sha256-cbor with the default seed.
VLLM_BLOCK0 = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"
VLLM_BLOCK0_EVENT = 2233398808101521225

NS = Namespace(model="kvtier/selftest", revision="0", attention="mha", num_layers=2, num_kv_heads=2,
               head_dim=64, kv_dtype="bfloat16", block_tokens=16, hash_tokens=16)
ERROR_BOUND = {"raw": 0.0, "int8": 0.01, "fp8_e4m3": 0.05, "int4": 0.10, "int2": 0.60}


def _report(ok: bool, what: str) -> bool:
    print(f"[{'ok' if ok else 'FAIL'}] {what}", flush=True)
    return ok


def _blocks(num_blocks: int) -> tuple[list[bytes], list[torch.Tensor]]:
    tokens = list(range(num_blocks * NS.block_tokens))
    hashes = NS.block_keys(tokens)
    gen = torch.Generator().manual_seed(0)
    shape = (NS.num_layers, 2, NS.num_kv_heads, NS.block_tokens, NS.head_dim)
    tensors = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in hashes]
    return hashes, tensors


def _records(hashes: list[bytes], tensors: list[torch.Tensor]) -> list[bytes]:
    return [encode_block(t, ns_id=NS.ns_id, chain_hash=h, parent_hash=hashes[i - 1] if i else None,
                         layout="canonical") for i, (h, t) in enumerate(zip(hashes, tensors))]


async def _put(store: TieredStore, hashes: list[bytes], records: list[bytes]) -> list[bool]:
    splits = [split_record(r) for r in records]
    res = await store.reserve(NS.ns_id, hashes, [len(p) for _, p in splits])
    for slot, (_, payload) in zip(res.slots, splits):
        if slot is not None:
            memcopy.copy(store.host.view(slot), payload)
    headers = [bytes(r[: len(r) - len(p)]) for r, (_, p) in zip(records, splits)]
    return await store.commit(res.lease_id, headers)


async def _get(store: TieredStore, hashes: list[bytes]) -> list[torch.Tensor]:
    acq = await store.acquire(NS.ns_id, hashes)
    try:
        return [decode_block(b.header + bytes(store.host.view(b.slot)))[1] for b in acq.blocks]
    finally:
        if acq.lease_id:
            store.release(acq.lease_id)


async def _selftest(data_dir: Path) -> bool:
    ok = True
    block0 = hash_block_tokens(NONE_HASH, list(range(16)))
    ok &= _report(block0.hex() == VLLM_BLOCK0 and event_hash(block0) == VLLM_BLOCK0_EVENT,
                  "vLLM sha256_cbor reference vector reproduces")

    hashes, tensors = _blocks(8)
    records = _records(hashes, tensors)
    cfg = StoreConfig(host_bytes=64 << 20, disk_path=str(data_dir), disk_bytes=256 << 20,
                      write_through=True, host_prefault=False, host_pin=False)
    async with TieredStore(cfg) as store:
        committed = await _put(store, hashes, records)
        ok &= _report(all(committed), f"{len(hashes)} blocks committed to host memory, written through to disk")
        got = await _get(store, hashes)
        ok &= _report(len(got) == len(tensors) and all(torch.equal(a, b) for a, b in zip(got, tensors)),
                      "blocks read back byte-identical through their shared-memory slots")

    async with TieredStore(cfg) as store:
        hit = store.lookup(NS.ns_id, hashes)
        ok &= _report(hit.num_hits == len(hashes), "after close and reopen the index is rebuilt from disk")
        _flip_last_payload_byte(store, NS.ns_id + hashes[-1])
        got = await _get(store, hashes)
        ok &= _report(len(got) == len(hashes) - 1 and all(torch.equal(a, b) for a, b in zip(got, tensors)),
                      "blocks promoted from disk verify and are byte-identical")
        ok &= _report(store.counters.checksum_failures == 1 and store.lookup(NS.ns_id, hashes).num_hits == len(hashes) - 1,
                      "a byte flipped on disk is detected: served as a miss and dropped, never as data")

    ok &= _codecs_round_trip(tensors[0], hashes[0])
    ok &= await _bulk_copy_round_trip()
    return ok


async def _bulk_copy_round_trip() -> bool:
    """A payload past the streaming threshold, at an odd offset, into a host slot and back."""
    n = 3 * (1 << 20) + 17
    payload = bytearray(torch.randint(0, 256, (n + 1,), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(1)).numpy().tobytes())
    back = bytearray(n)
    async with TieredStore(StoreConfig(host_bytes=16 << 20, host_prefault=False, host_pin=False)) as store:
        res = await store.reserve(NS.ns_id, [bytes(32)], [n])
        slot = res.slots[0]
        assert slot is not None and store.host is not None, "a 16 MiB host tier holds one 3 MiB block"
        memcopy.copy(store.host.view(slot), memoryview(payload)[1:])
        memcopy.copy(back, store.host.view(slot))
        store.release(res.lease_id)  # abandons the uncommitted slot
    if memcopy.NONTEMPORAL:
        which = f"kvtier.client.memcopy (C, non-temporal stores from {memcopy.NONTEMPORAL_MIN_BYTES >> 10} KiB)"
    elif memcopy.NATIVE:
        which = "kvtier.client.memcopy (C, plain memcpy: no streaming stores on this CPU)"
    else:
        which = "plain memcpy (kvtier.client._memcopy was not built: no C compiler at install?)"
    return _report(back == payload[1:], f"payload copies into and out of host slots: {which}")


def _flip_last_payload_byte(store: TieredStore, key: bytes) -> None:
    """Corrupt one stored record behind the store's back, as a failing disk would."""
    record = store.disk.get(key)
    _, payload = split_record(record)
    header_len = len(record) - len(payload)
    damaged = bytearray(payload)
    damaged[-1] ^= 0x01
    store.disk.put_many([(key, record[:header_len], bytes(damaged))])


def _codecs_round_trip(t: torch.Tensor, h: bytes) -> bool:
    ok = True
    ref = t.float()
    for codec, bound in ERROR_BOUND.items():
        rec = encode_block(t, ns_id=NS.ns_id, chain_hash=h, parent_hash=None, layout="canonical", codec=codec)
        _, back = decode_block(rec)
        err = float((back.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
        ok &= _report(err <= bound, f"codec {codec:8s} size ratio {t.numel() * 2 / len(rec):.2f} (raw / record), rel RMSE {err:.2%}")
    return ok


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvtier selftest`."""
    if args.data_dir:
        return 0 if asyncio.run(_selftest(Path(args.data_dir))) else 1
    with tempfile.TemporaryDirectory(prefix="kvtier-selftest-") as tmp:
        return 0 if asyncio.run(_selftest(Path(tmp))) else 1

