"""Fuzzing of the namespace map (``Namespace.from_wire``, as headers' ``ns_fields`` carry it) and of
the key inputs a request can carry (token ids, digests, hex keys, per-key arrays)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier_protocol import keys, messages, wire_checks
from kvtier_protocol.errors import KVTierError
from kvtier_protocol.frame_codec import DEFAULT_LIMITS
from kvtier_protocol.namespace import Namespace

from tests.protocol.fuzzkit import FUZZ, msgpack_values

BASE = Namespace(model="m", revision="r", attention="mha", num_layers=2, num_kv_heads=2, head_dim=8,
                 block_tokens=16, hash_tokens=4).to_wire()


def typed(call) -> object:  # noqa: ANN001 - any callable
    try:
        return call()
    except KVTierError:
        return None


@FUZZ
@given(msgpack_values)
def test_any_value_as_a_namespace(value: object) -> None:
    typed(lambda: Namespace.from_wire(value))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(BASE)), msgpack_values, max_size=4), st.lists(st.sampled_from(sorted(BASE)), max_size=3))
def test_namespace_fields_replaced_or_dropped(changes: dict, dropped: list) -> None:
    m = {**BASE, **changes}
    for k in dropped:
        m.pop(k, None)
    ns = typed(lambda: Namespace.from_wire(m))
    if ns is not None:  # a namespace that validates is usable: hashing works, ids are stable
        assert len(ns.ns_id) == 16 and Namespace.from_wire(ns.to_wire()).ns_id == ns.ns_id


@FUZZ
@given(msgpack_values, st.one_of(st.integers(-2, 70), msgpack_values), st.sampled_from(sorted(keys.SCHEMES) + ["x"]),
       msgpack_values)
def test_chain_hashes_of_any_tokens(tokens: object, hash_tokens: object, scheme: str, parent: object) -> None:
    typed(lambda: keys.chain_hashes(tokens, hash_tokens, scheme=scheme))  # type: ignore[arg-type]
    typed(lambda: keys.hash_block_tokens(parent, tokens, None, scheme=scheme))  # type: ignore[arg-type]


@FUZZ
@given(msgpack_values)
def test_key_forms_of_any_value(value: object) -> None:
    typed(lambda: keys.from_hex(value))
    typed(lambda: keys.to_hex(value))  # type: ignore[arg-type]
    typed(lambda: keys.event_hash(value))  # type: ignore[arg-type]
    typed(lambda: keys.check_chain_hash(value))
    typed(lambda: wire_checks.hashes("hashes", value, DEFAULT_LIMITS))
    typed(lambda: messages.token_lists("tokens", value, DEFAULT_LIMITS))
    typed(lambda: messages.unit_hash_lists("unit_hashes", value, DEFAULT_LIMITS))


@FUZZ
@given(st.text(max_size=70))
def test_hex_keys(text: str) -> None:
    digest = typed(lambda: keys.from_hex(text))
    if digest is not None:
        assert keys.to_hex(digest) == text
