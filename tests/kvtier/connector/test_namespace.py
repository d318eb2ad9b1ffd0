"""The namespace of a checkpoint: its revision is a digest of the weights, its geometry comes from
config.json (MHA/GQA with tensor parallelism, and DeepSeek-style MLA)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvtier.connector.namespace import checkpoint_digest, digested_files, hash_tokens_for, namespace_for_checkpoint
from kvtier_protocol.errors import NamespaceError

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 256, "rope_theta": 10000.0}
DEEPSEEK = {"model_type": "deepseek_v2", "num_hidden_layers": 3, "num_attention_heads": 8, "hidden_size": 256,
            "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}


def checkpoint(root: Path, config: dict, *, shards: int = 1) -> Path:
    """A small HF-style checkpoint: config.json and ``shards`` safetensors files of fixed weights."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    for i in range(shards):
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"w{i}": torch.randn(64, 64, generator=g)}, str(root / name))
    return root


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new mtime even on coarse clocks


def test_digest_is_stable_and_covers_weights_and_config(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", LLAMA, shards=2)
    (root / "README.md").write_text("not weights")
    (root / "model.safetensors.index.json").write_text("{}")
    assert digested_files(root) == ["config.json", "model-00001-of-00002.safetensors",
                                    "model-00002-of-00002.safetensors"]
    digest = checkpoint_digest(root)
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    assert checkpoint_digest(root) == digest
    (root / "README.md").write_text("edited")
    assert checkpoint_digest(root) == digest, "files without weights do not matter"
    same = checkpoint(tmp_path / "copy", LLAMA, shards=2)
    assert checkpoint_digest(same) == digest, "the digest does not depend on where the checkpoint lives"


def test_one_changed_weight_byte_changes_the_digest_and_the_namespace(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", LLAMA, shards=2)
    before = namespace_for_checkpoint(root, kv_dtype="float32")
    flip_one_byte(root / "model-00002-of-00002.safetensors")
    after = namespace_for_checkpoint(root, kv_dtype="float32")
    assert after.revision != before.revision and after.ns_id != before.ns_id
    flip_one_byte(root / "model-00002-of-00002.safetensors")  # back to the original bytes
    assert namespace_for_checkpoint(root, kv_dtype="float32") == before


def test_config_changes_and_new_shards_change_the_digest(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", LLAMA)
    digest = checkpoint_digest(root)
    (root / "config.json").write_text(json.dumps({**LLAMA, "rope_theta": 500000.0}))
    assert checkpoint_digest(root) != digest, "RoPE settings change the KV"
    (root / "config.json").write_text(json.dumps(LLAMA))
    assert checkpoint_digest(root) == digest
    save_file({"extra": torch.zeros(2)}, str(root / "extra.safetensors"))
    assert checkpoint_digest(root) != digest


def test_file_digests_are_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", LLAMA)
    weights = root / "model.safetensors"
    digest = checkpoint_digest(root)
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: the cached digest
    assert checkpoint_digest(root) == digest
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert checkpoint_digest(root) != digest


@pytest.mark.parametrize("block_tokens", [1, 8, 16, 32, 64, 256])
def test_hash_unit_is_the_block_by_default(tmp_path: Path, block_tokens: int) -> None:
    # One rule for every engine (vLLM's hash_block_size is its block size): same block size, same namespace.
    root = checkpoint(tmp_path / "m", LLAMA)
    ns = namespace_for_checkpoint(root, kv_dtype="float32", block_tokens=block_tokens)
    assert ns.hash_tokens == hash_tokens_for(block_tokens) == block_tokens and ns.units_per_block == 1
    with pytest.raises(NamespaceError):
        hash_tokens_for(0)


def test_mha_geometry_from_config_with_tensor_parallelism(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", LLAMA)
    ns = namespace_for_checkpoint(root, kv_dtype=torch.bfloat16, block_tokens=32, hash_tokens=16)
    assert (ns.model, ns.attention, ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.head_dim_v) == \
        ("llama", "mha", 4, 4, 32, 32)
    assert (ns.kv_dtype, ns.kv_codec, ns.block_tokens, ns.hash_tokens, ns.mla_rope_dim) == \
        ("bfloat16", "raw", 32, 16, 0)
    assert ns.revision == checkpoint_digest(root)
    tp = namespace_for_checkpoint(root, kv_dtype="bfloat16", tp_rank=1, tp_size=2)
    assert (tp.num_kv_heads, tp.tp_rank, tp.tp_size) == (2, 1, 2)
    assert namespace_for_checkpoint(root, kv_dtype="bfloat16", tp_size=8).num_kv_heads == 1  # replicated heads
    with pytest.raises(NamespaceError, match="do not split"):
        namespace_for_checkpoint(root, kv_dtype="bfloat16", tp_size=3)
    (root / "config.json").write_text(json.dumps({**LLAMA, "head_dim": 64}))
    assert namespace_for_checkpoint(root, kv_dtype="float32").head_dim == 64


def test_mla_geometry_from_config(tmp_path: Path) -> None:
    ns = namespace_for_checkpoint(checkpoint(tmp_path / "m", DEEPSEEK), kv_dtype="bfloat16")
    assert (ns.model, ns.attention, ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.head_dim_v, ns.mla_rope_dim) == \
        ("deepseek_v2", "mla", 3, 1, 64, 0, 16)
    other = {**LLAMA, "model_type": "custom", "kv_lora_rank": 32, "qk_rope_head_dim": 8}
    ns = namespace_for_checkpoint(checkpoint(tmp_path / "c", other), kv_dtype="float32")
    assert (ns.attention, ns.head_dim, ns.mla_rope_dim) == ("mla", 32, 8)


def test_every_namespace_option_is_its_own_namespace(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", LLAMA)
    base = namespace_for_checkpoint(root, kv_dtype="float32")
    variants = [namespace_for_checkpoint(root, kv_dtype="bfloat16"),
                namespace_for_checkpoint(root, kv_dtype="float32", codec="int8"),
                namespace_for_checkpoint(root, kv_dtype="float32", block_tokens=32),
                namespace_for_checkpoint(root, kv_dtype="float32", tenant_salt="tenant-a"),
                namespace_for_checkpoint(root, kv_dtype="float32", tp_rank=1, tp_size=2),
                namespace_for_checkpoint(root, kv_dtype="float32", model="meta-llama/Llama-3.2-1B")]
    assert len({base.ns_id, *(v.ns_id for v in variants)}) == 1 + len(variants)


def test_unusable_checkpoints_raise_namespace_errors(tmp_path: Path) -> None:
    with pytest.raises(NamespaceError, match="does not exist"):
        namespace_for_checkpoint(tmp_path / "missing", kv_dtype="float32")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(NamespaceError, match="no weight files"):
        namespace_for_checkpoint(empty, kv_dtype="float32")
    no_config = checkpoint(tmp_path / "nc", LLAMA)
    (no_config / "config.json").unlink()
    with pytest.raises(NamespaceError, match="no config.json"):
        namespace_for_checkpoint(no_config, kv_dtype="float32")
    bad = checkpoint(tmp_path / "bad", {"model_type": "llama", "num_attention_heads": 4})
    with pytest.raises(NamespaceError, match="num_hidden_layers"):
        namespace_for_checkpoint(bad, kv_dtype="float32")
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(NamespaceError, match="not a JSON object"):
        namespace_for_checkpoint(bad, kv_dtype="float32")
    with pytest.raises(NamespaceError, match="kv_dtype"):
        namespace_for_checkpoint(checkpoint(tmp_path / "ok", LLAMA), kv_dtype="int8")
