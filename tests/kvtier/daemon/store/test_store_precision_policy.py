"""Precision by tier (issue 25), the policy's two knobs: K's quantization axis on the disk tier
(``StoreConfig.disk_k_axis``) and per-model codecs (``StoreConfig.disk_models``).

Real stores (shared-memory host tier, RocksDB + O_DIRECT disk tier) and real records
(:func:`kvtier_protocol.block.encode_block`); each disk record is compared byte for byte with what
the protocol's own encoder writes for the block with the parameters the policy names.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.header import decode_header
from kvtier_protocol.namespace import Namespace
from kvtier_protocol.quant import QuantParams

from kvtier.daemon.store.config import StoreConfig, StoreConfigError, codec_for_model, tier_quant
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.store.storekit import NS, put
from tests.kvtier.daemon.store.test_store_precision import kv, kv_rec


def int8_spec_payload_len(L: int, H: int, T: int, D: int, k_axis: str) -> int:
    """SPEC.md §5.3's int8 payload length of an MHA block (float16 scales, whole-axis groups, V
    per token): codes, then scales and mins of ``N_p`` pairs per part and layer."""
    n_v = H * T  # "token": H * T * ceil(D / D)
    n_k = H * T if k_axis == "token" else H * D  # "channel": H * ceil(T / T) * D
    return L * 2 * H * T * D + 2 * L * (n_k + n_v) * 2


def per_token_int8_bound(x: torch.Tensor) -> torch.Tensor:
    """SPEC 5.4's error per element of int8 with K and V both per token over whole rows: S/2, the
    float16 rounding of S (times the code, at most 255) and of M, and the rounding of the decoded
    float32 to bfloat16 (2^-8 relative; 2^-7 taken)."""
    xf = x.float()
    mn, mx = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    s = (mx - mn) / 255
    return s * (0.5 + 255 * 2**-11) + mn.abs() * 2**-11 + xf.abs() * 2**-7


async def test_k_per_token_on_disk_is_smaller_and_decodes_within_int8s_error(open_store) -> None:
    rng = random.Random(25)
    L, H, T, D = 1, 2, 16, 128  # head dim 128 at 16-token blocks: the capacity case
    xs = [kv(rng, (L, 2, H, T, D), torch.bfloat16) for _ in range(4)]
    recs = [kv_rec(i, x) for i, x in enumerate(xs)]
    size = len(recs[0].payload)
    store = await open_store(host_bytes=2 * size, host_segment_bytes=2 * size, disk_codec="int8",
                             disk_k_axis="token")
    for r in recs:  # one at a time: each put evicts the least recent host block to disk
        assert await put(store, [r]) == [True]
    for i in (0, 1):
        assert store.info(NS, recs[i].chain_hash).tiers == [Tier.DISK]
        record = store.disk.get(make_key(NS, recs[i].chain_hash))
        h, y = decode_block(record)
        assert h.codec == "int8"
        assert h.quant == QuantParams(8, "token", "token", 0, 0, "float16", 0)  # K per token, whole rows
        assert h.payload_len == int8_spec_payload_len(L, H, T, D, "token") == 8448
        # 1.94x fewer payload bytes than raw bfloat16, against 1.75x with K per channel (SPEC 5.9)
        assert size / h.payload_len > 1.9 > size / int8_spec_payload_len(L, H, T, D, "channel")
        want = encode_block(xs[i], ns_id=NS, chain_hash=recs[i].chain_hash, parent_hash=h.parent_hash,
                            layout="canonical", codec="int8", quant=h.quant)
        assert record == want  # the very bytes the protocol's encoder writes with these parameters
        err = (y.double() - xs[i].double()).abs()
        assert bool((err <= per_token_int8_bound(xs[i]).double()).all()), float(err.max())
    assert store.counters.tiers[Tier.DISK].recoded == 2
    assert (await store.check()).ok


MLA_NS = Namespace(model="mla-model", revision="r", attention="mla", num_layers=2, num_kv_heads=1, head_dim=64,
                   head_dim_v=0, mla_rope_dim=8, kv_dtype="bfloat16")
AXIS_CASES = [  # (codec, layout, shape, rope dims, the quant the disk record must carry)
    ("int4", "canonical", (2, 2, 2, 16, 64), 0, QuantParams(4, "token", "token", 32, 32, "float16", 0)),
    ("int2", "canonical", (1, 2, 2, 16, 64), 0, QuantParams(2, "token", "token", 32, 32, "float16", 0)),
    ("fp8_e4m3", "canonical", (1, 2, 2, 16, 64), 0, None),  # fp8 ignores axes (SPEC 5.7): its defaults
    ("int8", "mla-latent", (2, 16, 72), 8, None),  # MLA's latent is per token anyway (SPEC 5.8): its defaults
]


@pytest.mark.parametrize("codec,layout,shape,rope,quant", AXIS_CASES, ids=[f"{c[0]}-{c[1]}" for c in AXIS_CASES])
async def test_k_axis_token_applies_to_mha_int_codecs_only(open_store, codec, layout, shape, rope, quant) -> None:
    rng = random.Random(codec + layout)
    ns_id = MLA_NS.ns_id if rope else NS
    xs = [kv(rng, shape, torch.bfloat16) for _ in range(3)]
    recs = [kv_rec(i, x, layout=layout, ns=ns_id) for i, x in enumerate(xs)]
    size = len(recs[0].payload)
    store = await open_store(host_bytes=2 * size, host_segment_bytes=2 * size, disk_codec=codec,
                             disk_k_axis="token")
    if rope:
        store.register_namespace(MLA_NS)
    for r in recs:
        assert await put(store, [r]) == [True]
    assert store.info(ns_id, recs[0].chain_hash).tiers == [Tier.DISK]
    record = store.disk.get(make_key(ns_id, recs[0].chain_hash))
    h = decode_header(record)[0]
    want = encode_block(xs[0], ns_id=ns_id, chain_hash=recs[0].chain_hash, parent_hash=None, layout=layout,
                        codec=codec, quant=quant, mla_rope_dim=rope)
    assert record == want
    if quant is not None:
        assert h.quant == quant
    assert tier_quant(codec, "token", mla=bool(rope)) == quant


# --- per-model codecs -----------------------------------------------------------------------------

def _ns(model: str) -> Namespace:
    return Namespace(model=model, revision="r", attention="mha", num_layers=1, num_kv_heads=2, head_dim=64,
                     block_tokens=16, hash_tokens=16, kv_dtype="bfloat16")


SHAPE = (1, 2, 2, 16, 64)
MODELS = (("llama-exact*", "raw"), ("llama-*", "int8"), ("*-draft", "int4"))
"""First match wins: llama-exact-8b matches the first two patterns and is kept raw."""


async def test_a_blocks_namespace_model_picks_its_disk_codec_first_match_winning(open_store) -> None:
    rng = random.Random(3)
    registered = {m: _ns(m) for m in ("llama-exact-8b", "llama-70b", "tiny-draft", "mistral")}
    cases = [(ns.ns_id, m) for m, ns in registered.items()] + [(NS, None)]  # NS: never registered
    want = {"llama-exact-8b": "raw", "llama-70b": "int8", "tiny-draft": "int4", "mistral": "fp8_e4m3",
            None: "fp8_e4m3"}  # the tier's codec where no pattern matches or the model is unknown
    xs = [kv(rng, SHAPE, torch.bfloat16) for _ in cases]
    recs = [kv_rec(0, x, ns=ns_id) for x, (ns_id, _) in zip(xs, cases)]
    fillers = [kv_rec(i, kv(rng, SHAPE, torch.bfloat16), ns=bytes(16)) for i in range(2)]
    size = len(recs[0].payload)
    store = await open_store(host_bytes=2 * size, host_segment_bytes=2 * size, disk_codec="fp8_e4m3",
                             disk_models=MODELS)
    for ns in registered.values():
        store.register_namespace(ns)
    for r in recs + fillers:  # the fillers push the last blocks down too
        assert await put(store, [r]) == [True]
    for (ns_id, model), r in zip(cases, recs):
        assert store.info(ns_id, r.chain_hash).tiers == [Tier.DISK], model
        record = store.disk.get(make_key(ns_id, r.chain_hash))
        h, _ = decode_block(record)
        assert h.codec == want[model], model
        if want[model] == "raw":
            assert record == r.header + r.payload  # exact: the record as the client wrote it
        # An exact-only request finds the raw model's block, and none of the re-encoded ones.
        exact = store.lookup_names(ns_id, [r.chain_hash], accept_lossy=False)
        assert exact == ((1, ["disk"]) if want[model] == "raw" else (0, [])), model
    assert store.counters.tiers[Tier.DISK].recoded == 4
    assert (await store.check()).ok


async def test_a_model_table_makes_a_raw_tier_lossy_for_the_models_it_names(open_store) -> None:
    rng = random.Random(4)
    draft, main = _ns("tiny-draft"), _ns("main")
    recs = [kv_rec(0, kv(rng, SHAPE, torch.bfloat16), ns=draft.ns_id),
            kv_rec(0, kv(rng, SHAPE, torch.bfloat16), ns=main.ns_id)]
    fillers = [kv_rec(i, kv(rng, SHAPE, torch.bfloat16), ns=bytes(16)) for i in range(2)]
    size = len(recs[0].payload)
    store = await open_store(host_bytes=2 * size, host_segment_bytes=2 * size, disk_models={"*-draft": "int8"})
    assert store.config.disk_codec == "raw" and store.config.disk_recodes
    store.register_namespace(draft)
    store.register_namespace(main)
    for r in recs + fillers:
        assert await put(store, [r]) == [True]
    got = [decode_header(store.disk.get(make_key(r.ns_id, r.chain_hash)))[0].codec for r in recs]
    assert got == ["int8", "raw"]
    assert store.disk.get(make_key(main.ns_id, recs[1].chain_hash)) == recs[1].header + recs[1].payload


def test_codec_for_model_takes_the_first_matching_pattern() -> None:
    assert codec_for_model(MODELS, "fp8_e4m3", "llama-exact-8b") == "raw"
    assert codec_for_model(MODELS, "fp8_e4m3", "llama-70b") == "int8"
    assert codec_for_model(MODELS, "fp8_e4m3", "tiny-draft") == "int4"
    assert codec_for_model(MODELS, "fp8_e4m3", "Llama-70b") == "fp8_e4m3"  # case-sensitive
    assert codec_for_model(MODELS, "fp8_e4m3", None) == "fp8_e4m3"
    assert codec_for_model((("*", "int2"), ("llama-*", "raw")), "raw", "llama-1") == "int2"  # order, not specificity


@pytest.mark.parametrize("field, value, words", [
    ("disk_k_axis", "row", "disk_k_axis"),
    ("disk_k_axis", 1, "disk_k_axis"),
    ("disk_models", {"llama*": "int3"}, r"disk_models\['llama\*'\]"),
    ("disk_models", {"": "raw"}, "pattern ''"),
    ("disk_models", {"a\x00b": "raw"}, "pattern"),
    ("disk_models", {"x" * 257: "raw"}, "pattern"),
    ("disk_models", {"a": 8}, r"disk_models\['a'\]"),
    ("disk_models", (("a", "raw"), ("a", "int8")), "appears twice"),
    ("disk_models", "a=raw", "table"),
    ("disk_models", {f"m{i}": "raw" for i in range(257)}, "at most 256"),
])
def test_bad_policy_values_are_refused_naming_the_field(field, value, words) -> None:
    with pytest.raises(StoreConfigError, match=words):
        StoreConfig(host_bytes=1 << 20, **{field: value})


def test_the_models_table_is_kept_in_order_as_pairs() -> None:
    cfg = StoreConfig(host_bytes=1 << 20, disk_models={"b*": "int8", "a*": "raw"})
    assert cfg.disk_models == (("b*", "int8"), ("a*", "raw"))
    assert hash(cfg) == hash(StoreConfig(host_bytes=1 << 20, disk_models=[("b*", "int8"), ("a*", "raw")]))
    assert not StoreConfig(host_bytes=1 << 20, disk_models={"a*": "raw"}).disk_recodes
