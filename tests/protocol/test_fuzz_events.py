"""Fuzzing of KV event batches and their ZMQ frames: only EventError / LimitExceeded come out."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier_protocol import events as ev
from kvtier_protocol.errors import KVTierError

from tests.protocol.fuzzkit import FUZZ, msgpack_values

VECTORS = sorted((Path(__file__).resolve().parents[2] / "protocol" / "vectors" / "events").glob("*.bin"))
SEEDS = [p.read_bytes() for p in VECTORS]
FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
          "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
          "locality", "ownership", "session_id", "lookahead_token_ids"]


def decode(buf: bytes) -> None:
    for packed in (False, True):  # the vLLM forms, and kvtier's packed form (SPEC 9.8)
        try:
            ev.decode_batch(buf, packed=packed)
        except KVTierError:
            pass


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    decode(data)
    decode(b"\x93\xcb" + data)


@FUZZ
@given(msgpack_values)
def test_any_msgpack_value(value: object) -> None:
    decode(msgpack.packb(value, use_bin_type=True))
    decode(msgpack.packb([1.5, [value], 0], use_bin_type=True))


@FUZZ
@given(st.sampled_from(SEEDS), st.integers(0, 7), st.sampled_from(FIELDS), msgpack_values, st.booleans())
def test_one_event_field_replaced(seed: bytes, index: int, name: str, value: object, legacy: bool) -> None:
    """Every field of a golden event, in map or legacy array form, set to any value."""
    ts, events, *rest = msgpack.unpackb(seed, raw=False)
    if not events:
        return
    event = events[index % len(events)]
    if isinstance(event, dict):
        event[name] = value
    elif len(event) > 1:
        event[1 + FIELDS.index(name) % (len(event) - 1)] = value
    decode(msgpack.packb([ts, events, *rest], use_bin_type=True))


@FUZZ
@given(st.lists(st.binary(max_size=20), max_size=6))
def test_zmq_frames(frames: list[bytes]) -> None:
    for parse in (ev.parse_live_message, ev.parse_replay_request, ev.parse_replay_reply):
        try:
            parse(frames)
        except KVTierError:
            pass
    try:
        ev.parse_topic(frames[0] if frames else b"")
    except KVTierError:
        pass


def test_oversize_batches_are_refused_before_decoding() -> None:
    limits = ev.EventLimits(max_batch_bytes=64, max_events=2, max_list_len=3)
    with pytest.raises(KVTierError, match="limit"):
        ev.decode_batch(b"\x00" * 65, limits)
    many = msgpack.packb([0.0, [{"type": "AllBlocksCleared"}] * 3])
    with pytest.raises(KVTierError):
        ev.decode_batch(many, limits)
    deep: object = 1
    for _ in range(9):
        deep = [deep]
    bad = msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1,
                                "extra_keys": [deep]}]])
    with pytest.raises(KVTierError):
        ev.decode_batch(bad)
