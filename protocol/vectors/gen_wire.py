"""Generate the golden vectors of data-plane frames and KV event batches (SPEC.md §7, §9).

Run from anywhere: ``python protocol/vectors/gen_wire.py``. It writes ``frames/*.bin|json`` and
``events/*.bin|json`` next to this file. Everything is fixed (no clock, no randomness), so two
runs give identical bytes; tests/protocol checks that the files on disk equal what the code
generates now, that each decodes to its JSON description, and that each re-encodes identically.

In the JSON files a msgpack ``bin`` value is written ``{"bin": "<lowercase hex>"}``; every other
value is the plain msgpack decoding (maps, arrays, strings, integers, floats, null, booleans).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the kvtier_protocol package root

import msgpack  # noqa: E402

from kvtier_protocol import events as ev  # noqa: E402
from kvtier_protocol import frames as fr  # noqa: E402
from kvtier_protocol.errors import NotFound  # noqa: E402

NS_ID = bytes(range(16))
"""A fixed 16-byte namespace id (vectors test framing, not namespace derivation)."""


def chain_hash(i: int) -> bytes:
    """A fixed 32-byte stand-in for a chain hash."""
    return hashlib.sha256(b"kvtier-wire-vector-%d" % i).digest()


def record(i: int, n: int) -> bytes:
    """``n`` fixed bytes standing in for block record ``i`` (opaque to the frame layer)."""
    return bytes((i * 31 + k) & 0xFF for k in range(n))


def to_json(value: Any) -> Any:
    """The JSON description of a decoded msgpack value (bin becomes ``{"bin": hex}``)."""
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def from_json(value: Any) -> Any:
    """Inverse of :func:`to_json`."""
    if isinstance(value, dict):
        if set(value) == {"bin"}:
            return bytes.fromhex(value["bin"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


OPAQUE = ("Block records and block headers here are placeholder bytes: the frame layer treats "
          "them as opaque, so these vectors test framing only.")

FRAME_MESSAGES: list[tuple[str, str, fr.Message]] = [
    ("hello_request", "hello with tenant and token", fr.HelloRequest(
        id=1, version=1, client="kvtier-vllm/0.1", tenant="team-a", token="s3cret")),
    ("hello_response", "hello response over a unix socket: one segment, its fd attached",
     fr.HelloResponse(id=1, version=1, server="kvtierd/0.1.0", limits=fr.Limits(),
                      segments=(fr.Segment("kvtier-host-0", 1 << 30),), fds=1)),
    ("lookup_request", "lookup of three keys", fr.LookupRequest(
        id=2, ns_id=NS_ID, hashes=(chain_hash(0), chain_hash(1), chain_hash(2)))),
    ("lookup_response", "the first two keys hit, in host and disk", fr.LookupResponse(
        id=2, num_hits=2, tiers=("host", "disk"))),
    ("reserve_request", "reserve three slots for 4096-byte records", fr.ReserveRequest(
        id=3, ns_id=NS_ID, hashes=(chain_hash(2), chain_hash(3), chain_hash(4)),
        sizes=(4096, 4096, 4096), lease_ms=30_000, priority=1)),
    ("reserve_response", "one slot, one key already stored, one without room", fr.ReserveResponse(
        id=3, lease=7, slots=((0, 8192, 4096), "exists", None))),
    ("commit_request", "commit the one written slot of lease 7. " + OPAQUE, fr.CommitRequest(
        id=4, lease=7, headers=(record(2, 48), None, None))),
    ("commit_response", "one block made visible", fr.CommitResponse(id=4, committed=1)),
    ("acquire_request", "acquire two keys for reading", fr.AcquireRequest(
        id=5, ns_id=NS_ID, hashes=(chain_hash(0), chain_hash(5)), lease_ms=10_000)),
    ("acquire_response", "first key pinned in segment 0, second missing. " + OPAQUE,
     fr.AcquireResponse(id=5, lease=8, slots=((0, 0, 4096), None),
                        headers=(record(0, 48), None))),
    ("release_request", "release lease 8", fr.ReleaseRequest(id=6, lease=8)),
    ("put_request", "TCP put of two records (40 and 24 bytes). " + OPAQUE, fr.PutRequest(
        id=7, ns_id=NS_ID, hashes=(chain_hash(6), chain_hash(7)), lens=(40, 24), priority=0,
        payload=record(6, 40) + record(7, 24))),
    ("put_response", "first stored, second already there", fr.PutResponse(
        id=7, results=("stored", "exists"))),
    ("get_response", "TCP get of three keys, the second missing. " + OPAQUE, fr.GetResponse(
        id=8, lens=(40, None, 24), payload=record(6, 40) + record(7, 24))),
    ("ping_request", "ping", fr.PingRequest(id=9)),
    ("grant_request", "grant two slots of 4096 bytes ahead of their keys", fr.GrantRequest(
        id=10, sizes=(4096, 4096), lease_ms=30_000, priority=0)),
    ("grant_response", "one slot granted, no room for the second", fr.GrantResponse(
        id=10, lease=9, slots=((0, 12288, 4096), None))),
    ("place_request", "the block of key 8 was written into slot 0 of grant 9. " + OPAQUE, fr.PlaceRequest(
        id=11, lease=9, ns_id=NS_ID, hashes=(chain_hash(8),), positions=(0,), headers=(record(8, 48),))),
    ("place_response", "the block is visible", fr.PlaceResponse(id=11, results=("stored",))),
    ("release_response", "lease 8 ended (no op-specific keys)", fr.ReleaseResponse(id=6)),
    ("get_request", "TCP get of three keys (answered by get_response)", fr.GetRequest(
        id=8, ns_id=NS_ID, hashes=(chain_hash(6), chain_hash(9), chain_hash(7)))),
    ("ping_response", "the answer to ping id 9 (no op-specific keys)", fr.PingResponse(id=9)),
    ("delete_request", "drop two keys from every tier", fr.DeleteRequest(
        id=12, ns_id=NS_ID, hashes=(chain_hash(0), chain_hash(5)))),
    ("delete_response", "one of the two keys existed", fr.DeleteResponse(id=12, deleted=1)),
    ("clear_request", "drop every block of the namespace", fr.ClearRequest(id=13, ns_id=NS_ID)),
    ("clear_response", "42 blocks were dropped", fr.ClearResponse(id=13, deleted=42)),
    ("stats_request", "stats (no request keys)", fr.StatsRequest(id=14)),
    ("stats_response", "an informative stats map: scalars of every allowed type and a nested map "
     "(counter names are not part of the contract)", fr.StatsResponse(id=14, stats={
         "version": "0.1.0", "blocks": 3, "hit_rate": 0.5, "draining": False, "peer": None,
         "tiers": {"host": {"bytes": 12288, "capacity": 1 << 30}}})),
]


def frame_vectors() -> dict[str, tuple[bytes, dict[str, Any]]]:
    """Every frame vector: relative path stem -> (bytes, JSON description)."""
    out: dict[str, tuple[bytes, dict[str, Any]]] = {}
    for name, description, message in FRAME_MESSAGES:
        out[f"frames/{name}"] = _frame_vector(name, description, message.to_header(),
                                              message.frame_payload(), type(message).__name__)
    header = fr.error_response(6, NotFound("no lease 8"), op="release")
    out["frames/error_response"] = _frame_vector(
        "error_response", "release of an unknown lease answered with not_found", header, None,
        None)
    return out


def _frame_vector(name: str, description: str, header: dict[str, Any], payload: Any,
                  typed: str | None) -> tuple[bytes, dict[str, Any]]:
    data = fr.encode_frame_bytes(header, payload)
    magic, version, flags, header_len, payload_len = fr.PREAMBLE.unpack_from(data)
    body = data[fr.PREAMBLE_LEN + header_len:]
    return data, {
        "name": name, "description": description, "kind": "frame", "typed": typed,
        "preamble": {"magic": magic.decode(), "version": version, "flags": flags,
                     "header_len": header_len, "payload_len": payload_len},
        "header": to_json(header),
        "payload": {"bin": body.hex()} if flags & fr.FLAG_PAYLOAD else None,
    }


SECTION_4_2 = ev.EventBatch(1700000000.5, (
    ev.BlockStored(block_hashes=(123,), parent_block_hash=None, token_ids=(1, 2, 3, 4),
                   block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                   kv_cache_spec_kind="full_attention"),
    ev.BlockRemoved(block_hashes=(123,), medium="GPU", group_idx=0),
    ev.AllBlocksCleared(),
), 0)
"""The batch printed in reference/engine-interfaces.md §4.2 (verified against vLLM 0.33)."""

TIERS_BATCH = ev.EventBatch(1764460800.25, (
    # vLLM sha256_cbor hash of tokens 0..15 (default seed), in its u64 event form
    ev.BlockStored(block_hashes=(2233398808101521225,), parent_block_hash=None,
                   token_ids=tuple(range(16)), block_size=16, lora_id=None, medium="CPU",
                   lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
    ev.BlockStored(block_hashes=(2233398808101521225,), parent_block_hash=None,
                   token_ids=tuple(range(16)), block_size=16, lora_id=None, medium="STORAGE",
                   lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
    ev.BlockRemoved(block_hashes=(2233398808101521225,), medium="CPU", group_idx=0),
), 0)

FULL_BATCH = ev.EventBatch(1764460801.0, (
    ev.BlockStored(block_hashes=(chain_hash(0), chain_hash(1)), parent_block_hash=chain_hash(9),
                   token_ids=tuple(range(100, 108)), block_size=4, lora_id=3, medium="CPU",
                   lora_name="adapter-a", extra_keys=(("adapter-a", "salt-1"), None),
                   group_idx=1, kv_cache_spec_kind="sliding_window",
                   kv_cache_spec_sliding_window=4096, locality="LOCAL", ownership="kvtier",
                   session_id="session-42", lookahead_token_ids=(7, 8)),
    ev.BlockRemoved(block_hashes=(chain_hash(0),), medium="CPU", group_idx=1, locality="LOCAL",
                    ownership="kvtier"),
), None)

WIDE_ID_BATCH = ev.EventBatch(1764460802.5, (
    ev.BlockStored(block_hashes=(5,), parent_block_hash=None, token_ids=(1, 1 << 32, 3, 4), block_size=4,
                   lora_id=None, medium="CPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
    ev.BlockStored(block_hashes=(6,), parent_block_hash=5, token_ids=(0xFFFFFFFF, 0, 0x01020304, 127),
                   block_size=4, lora_id=None, medium="CPU", lora_name=None, group_idx=0,
                   kv_cache_spec_kind="full_attention"),
), 0)
"""The packed form (SPEC §9.8) of a batch whose first event has an id above 32 bits."""

EVENT_BATCHES: list[tuple[str, str, ev.EventBatch, str]] = [
    ("map_example", "engine-interfaces.md §4.2 example, map encoding", SECTION_4_2, "map"),
    ("legacy_example", "the same batch in the legacy array encoding", SECTION_4_2, "legacy"),
    ("map_tiers", "what kvtierd publishes: a block stored in host (CPU) and disk (STORAGE), then "
     "removed from host; hash of tokens 0..15 in vLLM's u64 form", TIERS_BATCH, "map"),
    ("map_all_fields", "every optional field set, 32-byte digest hashes, no data_parallel_rank "
     "(a two-element batch)", FULL_BATCH, "map"),
    ("legacy_all_fields", "the same in the legacy encoding", FULL_BATCH, "legacy"),
    ("packed_tiers", "map_tiers in kvtier's packed form (SPEC §9.8): token_ids as a bin of "
     "little-endian u32s", TIERS_BATCH, "packed"),
    ("packed_all_fields", "map_all_fields in the packed form: token_ids and lookahead_token_ids as "
     "bins", FULL_BATCH, "packed"),
    ("packed_wide_id", "the packed form where an id is 2**32: that event keeps the token_ids array, "
     "the next one (ids 0xffffffff, 0, 0x01020304, 127) is packed", WIDE_ID_BATCH, "packed"),
]


def event_vectors() -> dict[str, tuple[bytes, dict[str, Any]]]:
    """Every event-batch vector: relative path stem -> (bytes, JSON description)."""
    out = {}
    for name, description, batch, encoding in EVENT_BATCHES:
        data = ev.encode_batch(batch, legacy=encoding == "legacy", packed=encoding == "packed")
        out[f"events/{name}"] = (data, {
            "name": name, "description": description, "kind": "event_batch",
            "encoding": encoding,
            "event_types": [type(e).__name__ for e in batch.events],
            "msgpack": to_json(msgpack.unpackb(data, raw=False)),
        })
        if encoding == "packed":  # what a packed decoder gives for the bins (SPEC §9.8)
            out[f"events/{name}"][1]["token_ids"] = [
                {f: list(getattr(e, f)) for f in ("token_ids", "lookahead_token_ids") if getattr(e, f) is not None}
                if isinstance(e, ev.BlockStored) else None for e in batch.events]
    return out


def all_vectors() -> dict[str, tuple[bytes, dict[str, Any]]]:
    """Frame and event vectors together."""
    return {**frame_vectors(), **event_vectors()}


def json_text(description: dict[str, Any]) -> str:
    """The exact text written to a vector's .json file."""
    return json.dumps(description, indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    for stem, (data, description) in all_vectors().items():
        path = HERE / stem
        path.parent.mkdir(exist_ok=True)
        path.with_suffix(".bin").write_bytes(data)
        path.with_suffix(".json").write_text(json_text(description), encoding="utf-8")
        print(f"{stem}: {len(data)} bytes")


if __name__ == "__main__":
    main()
