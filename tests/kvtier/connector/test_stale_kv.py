"""Stale KV never becomes a hit: a weight change, a dtype change or a layout change (vLLM's packed
K|V pages, ``vllm-nhc`` [L, T, H, 2D]) either misses or converts exactly, end to end through a real
daemon. Misses come from the namespace (weights digest, dtype, geometry are in ``ns_id``); forged
records that claim a namespace they do not fit are refused by the daemon's header checks (when the
namespace is registered) and by the reader's decode checks (always), and the reader's pages stay
untouched."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.client import Client
from kvtier.connector import KVConnectorCore, namespace_for_checkpoint
from kvtier.connector.pages import gather_block, get_page_layout
from kvtier_protocol.block import encode_block
from kvtier_protocol.errors import KVTierError
from kvtier_protocol.layouts import convert
from kvtier_protocol.namespace import Namespace

from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.connector.connkit import make_caches, tokens

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 32, "rope_theta": 10000.0}  # head_dim 8


def checkpoint(root: Path, weights: bytes, config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or CONFIG))
    (root / "model.safetensors").write_bytes(weights)
    return root


@pytest.fixture
def cores(kvtier_daemon_module: KvtierDaemon) -> Iterator[list[KVConnectorCore]]:
    made: list[KVConnectorCore] = []
    yield made
    for core in made:
        core.close()


def engine(cores: list, d: KvtierDaemon, ns: Namespace, layout: str = "vllm-flash", *,
           seed: int | None = None) -> tuple[KVConnectorCore, list[torch.Tensor]]:
    core = KVConnectorCore(ns, address=d.address, page_layout=layout, timeout_s=60.0)
    cores.append(core)
    caches = make_caches(ns, layout, num_pages=6, seed=seed)
    core.bind_kv_caches(caches)
    return core, caches


def untouched(caches: list[torch.Tensor]) -> bool:
    return all(not c.any() for c in caches)


def test_a_weight_change_is_a_miss(kvtier_daemon_module: KvtierDaemon, cores: list, tmp_path: Path) -> None:
    weights = secrets.token_bytes(4096)
    model = f"stale-{secrets.token_hex(4)}"
    old = namespace_for_checkpoint(checkpoint(tmp_path / "v1", weights), kv_dtype="bfloat16", block_tokens=4, hash_tokens=4,
                                   model=model)
    prompt = tokens(12, seed=1)
    writer, _ = engine(cores, kvtier_daemon_module, old, seed=1)
    keys = writer.block_hashes(prompt)
    assert writer.save(keys, [0, 1, 2], token_ids=prompt) == 3
    same, _ = engine(cores, kvtier_daemon_module, namespace_for_checkpoint(
        checkpoint(tmp_path / "copy", weights), kv_dtype="bfloat16", block_tokens=4, hash_tokens=4, model=model))
    assert same.lookup(keys) == 3, "the same weights in another directory share KV"

    flipped = bytearray(weights)
    flipped[2000] ^= 0x01  # one bit of one weight
    variants = {"weights": checkpoint(tmp_path / "v2", bytes(flipped)),
                "config": checkpoint(tmp_path / "v3", weights, {**CONFIG, "rope_theta": 500000.0}),
                "extra shard": checkpoint(tmp_path / "v4", weights)}
    (variants["extra shard"] / "model-00002.safetensors").write_bytes(b"\x00" * 16)
    for what, root in variants.items():
        ns = namespace_for_checkpoint(root, kv_dtype="bfloat16", block_tokens=4, hash_tokens=4, model=model)
        assert ns.ns_id != old.ns_id, what
        reader, caches = engine(cores, kvtier_daemon_module, ns)
        assert reader.block_hashes(prompt) == keys, "keys name tokens: only the namespace tells the KV apart"
        assert reader.lookup(keys) == 0 and reader.load(keys, [0, 1, 2]) == 0, what
        assert untouched(caches), what


def test_a_dtype_change_is_a_miss_and_forged_records_never_load(kvtier_daemon_module: KvtierDaemon,
                                                                  cores: list, tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "ckpt", secrets.token_bytes(1024))
    model = f"stale-{secrets.token_hex(4)}"
    bf16 = namespace_for_checkpoint(root, kv_dtype="bfloat16", block_tokens=4, hash_tokens=4, model=model)
    fp16 = namespace_for_checkpoint(root, kv_dtype="float16", block_tokens=4, hash_tokens=4, model=model)
    assert bf16.ns_id != fp16.ns_id and bf16.block_payload_bytes() == fp16.block_payload_bytes()
    prompt = tokens(8, seed=2)
    writer, wcaches = engine(cores, kvtier_daemon_module, bf16, seed=2)
    keys = writer.block_hashes(prompt)
    assert writer.save(keys, [0, 1]) == 2
    reader, caches = engine(cores, kvtier_daemon_module, fp16)
    assert reader.lookup(keys) == 0 and reader.load(keys, [0, 1]) == 0 and untouched(caches)

    # A forger stores bfloat16 bytes under the float16 namespace id (same byte count). Before the
    # namespace is registered the daemon cannot know; the reader's decode check refuses the block.
    page = get_page_layout("vllm-flash")
    forged = [(k, encode_block(gather_block(wcaches, i, page), ns_id=fp16.ns_id, chain_hash=k,
                               parent_hash=keys[i - 1] if i else None, layout="vllm-flash"))
              for i, k in enumerate(keys)]
    with Client.connect(kvtier_daemon_module.address) as client:
        assert client.save(fp16.ns_id, forged) == ["stored", "stored"]
    assert reader.lookup(keys) == 2, "the forged blocks are stored..."
    assert reader.load(keys, [0, 1]) == 0 and untouched(caches), "...but never loaded as float16 KV"

    # Once a block with the namespace map registered float16, the daemon refuses the lie itself.
    fp16_writer, _ = engine(cores, kvtier_daemon_module, fp16, seed=3)
    other = fp16_writer.block_hashes(tokens(8, seed=3))
    assert fp16_writer.save(other, [0, 1]) == 2
    lie = [(k, encode_block(gather_block(wcaches, 0, page), ns_id=fp16.ns_id, chain_hash=k, parent_hash=None,
                            layout="vllm-flash", ns_fields=bf16.to_wire()))
           for k in [secrets.token_bytes(32)]]
    with Client.connect(kvtier_daemon_module.address) as client, pytest.raises(KVTierError) as info:
        client.save(fp16.ns_id, lie)
    assert info.value.code in ("namespace", "bad_header"), info.value


def test_packed_kv_layout_converts_exactly_or_is_refused(kvtier_daemon_module: KvtierDaemon, cores: list,
                                                          tmp_path: Path) -> None:
    """vLLM's packed pages (vllm-nhc: K then V in the last axis) read by a flash-layout engine come
    out exactly converted; a packed record whose geometry is reinterpreted (4 heads x 4 dims
    instead of 2 x 8: the same number of bytes) never loads."""
    root = checkpoint(tmp_path / "ckpt", secrets.token_bytes(512))
    ns = namespace_for_checkpoint(root, kv_dtype="float32", block_tokens=4, hash_tokens=4,
                                  model=f"stale-{secrets.token_hex(4)}")
    prompt = tokens(8, seed=4)
    packed, pcaches = engine(cores, kvtier_daemon_module, ns, "vllm-nhc", seed=4)
    keys = packed.block_hashes(prompt)
    assert packed.save(keys, [3, 5]) == 2
    flash, fcaches = engine(cores, kvtier_daemon_module, ns, "vllm-flash")
    assert flash.load(keys, [0, 1]) == 2
    nhc, fl = get_page_layout("vllm-nhc"), get_page_layout("vllm-flash")
    for src, dst in ((3, 0), (5, 1)):
        want = convert(gather_block(pcaches, src, nhc), "vllm-nhc", "vllm-flash")
        assert torch.equal(gather_block(fcaches, dst, fl), want), "exact conversion of packed K|V"

    # Reinterpreted geometry: the packed bytes of block 0 declared as 4 heads of kvdim 8 (D = 4).
    block = gather_block(pcaches, 3, nhc)  # [L, T, H=2, 2D=16]
    wrong = block.reshape(ns.num_layers, 4, 4, 8)
    fresh = [secrets.token_bytes(32)]
    record = encode_block(wrong, ns_id=ns.ns_id, chain_hash=fresh[0], parent_hash=None, layout="vllm-nhc",
                          ns_fields=ns.to_wire())
    with Client.connect(kvtier_daemon_module.address) as client, pytest.raises(KVTierError) as info:
        client.save(ns.ns_id, [(fresh[0], record)])
    assert info.value.code in ("namespace", "bad_header")
    assert flash.lookup(fresh) == 0

    # In a namespace the daemon does not know yet, the same lie is stored but never loaded.
    unknown = Namespace.from_wire({**ns.to_wire(), "model": f"stale-{secrets.token_hex(4)}"})
    lie = encode_block(wrong, ns_id=unknown.ns_id, chain_hash=fresh[0], parent_hash=None, layout="vllm-nhc")
    with Client.connect(kvtier_daemon_module.address) as client:
        assert client.save(unknown.ns_id, [(fresh[0], lie)]) == ["stored"]
    reader, caches = engine(cores, kvtier_daemon_module, unknown, "vllm-nhc")
    assert reader.lookup(fresh) == 1 and reader.load(fresh, [0]) == 0 and untouched(caches)
    assert reader.fetch(fresh) == [], "the tensor API refuses it too"
