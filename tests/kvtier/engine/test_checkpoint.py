"""HF-format checkpoints: random ones are deterministic, shards load as one file, bad ones raise ModelError."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.engine.checkpoint import ModelError, load_config, load_model, make_random_checkpoint, weight_files
from kvtier.engine.config import ModelConfig
from kvtier_protocol.errors import InvalidRequest, KVTierError

CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
MLA = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=24, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, v_head_dim=12)
MOE = replace(MLA, num_layers=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              n_shared_experts=2, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
              topk_group=2, routed_scaling_factor=16.0)


def file_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_random_checkpoint_is_deterministic(tmp_path):
    make_random_checkpoint(tmp_path / "a", CFG, seed=3)
    make_random_checkpoint(tmp_path / "b", CFG, seed=3)
    make_random_checkpoint(tmp_path / "c", CFG, seed=4)
    assert file_bytes(tmp_path / "a") == file_bytes(tmp_path / "b")
    assert file_bytes(tmp_path / "a")["model.safetensors"] != file_bytes(tmp_path / "c")["model.safetensors"]


@pytest.mark.parametrize("cfg", [CFG, MLA], ids=["mha", "mla"])
def test_sharded_and_single_file_load_identically(tmp_path, cfg):
    make_random_checkpoint(tmp_path / "one", cfg, seed=1)
    make_random_checkpoint(tmp_path / "three", cfg, seed=1, shards=3)
    index = json.loads((tmp_path / "three" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [p.name for p in weight_files(tmp_path / "three")] == files
    single = load_model(tmp_path / "one")
    assert set(index["weight_map"]) == set(single.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in single.state_dict().values())
    assert_same_weights(single, load_model(tmp_path / "three"))


def test_tied_checkpoint_has_no_lm_head(tmp_path):
    make_random_checkpoint(tmp_path, replace(CFG, tie_word_embeddings=True))
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path)
    assert "lm_head.weight" not in model.state_dict()


def test_bf16_checkpoint_loads_into_float32(tmp_path):
    make_random_checkpoint(tmp_path / "bf16", CFG, seed=2, dtype=torch.bfloat16)
    make_random_checkpoint(tmp_path / "fp32", CFG, seed=2)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    low, full = load_model(tmp_path / "bf16"), load_model(tmp_path / "fp32")
    assert next(low.parameters()).dtype == torch.float32
    for name, t in full.state_dict().items():
        assert torch.equal(low.state_dict()[name], t.to(torch.bfloat16).float()), name


@pytest.mark.parametrize("cfg", [CFG, MLA, replace(CFG, rope_theta=5e5, rope_scaling=LLAMA3), MOE],
                         ids=["mha", "mla", "llama3", "mla-moe"])
def test_config_round_trips_through_hf_json(tmp_path, cfg):
    make_random_checkpoint(tmp_path, cfg)
    assert load_config(tmp_path) == cfg


def test_config_reads_transformers5_rope_parameters():
    d = CFG.to_hf()
    del d["rope_theta"], d["rope_scaling"]
    d["rope_parameters"] = {"rope_theta": 5e5, **LLAMA3}
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == LLAMA3
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    assert ModelConfig.from_hf(d).rope_scaling is None


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2"}, "unsupported model_type"),
    ({"hidden_size": None}, "missing required key 'hidden_size'"),
    ({"hidden_size": "64"}, "hidden_size must be an integer"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps must be a number"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"head_dim": 15}, "must be even"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "only rope_type 'llama3'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
    ({"tie_word_embeddings": "yes"}, "true or false"),
])
def test_bad_config_values_raise_model_error(change, message):
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_hf(CFG.to_hf() | change)


def test_moe_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    assert [MOE.is_moe_layer(i) for i in range(3)] == [False, True, True]
    every_other = ModelConfig.from_hf(MOE.to_hf() | {"num_hidden_layers": 6, "moe_layer_freq": 2})
    assert [every_other.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    assert not any(MLA.is_moe_layer(i) for i in range(MLA.num_layers))
    dense = ModelConfig.from_hf(MOE.to_hf() | {"n_routed_experts": None})  # DeepSeek's spelling of "no MoE"
    assert dense.n_routed_experts == 0 and not dense.is_moe_layer(2)


def test_moe_checkpoint_has_deepseek_tensor_names(tmp_path):
    make_random_checkpoint(tmp_path, MOE, seed=1)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp."
        assert {n.removeprefix(prefix) for n in names if n.startswith(prefix)} == {
            "gate.weight", *(f"shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")),
            *(f"experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down"))}
    model = load_model(tmp_path, dtype=torch.bfloat16)
    router = model.model.layers[1].mlp.gate.weight
    assert router.dtype == torch.float32  # the router scores in float32, as in transformers
    assert torch.equal(router, load_file(tmp_path / "model.safetensors")["model.layers.1.mlp.gate.weight"])
    assert model.model.layers[1].mlp.experts[7].down_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("change,message", [
    ({"norm_topk_prob": True}, "norm_topk_prob"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 5}, "topk_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
])
def test_bad_moe_config_values_raise_model_error(change, message):
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_hf(MOE.to_hf() | change)


def test_moe_needs_mla():
    with pytest.raises(ModelError, match="MLA"):
        replace(CFG, n_routed_experts=4, num_experts_per_tok=1, moe_intermediate_size=8)


@pytest.fixture()
def ckpt(tmp_path) -> Path:
    make_random_checkpoint(tmp_path, CFG, shards=2)
    return tmp_path


def rewrite_shard(root: Path, edit) -> None:
    """Apply ``edit(tensors)`` to the shard holding the first layer's q_proj."""
    name = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.0.self_attn.q_proj.weight"]
    tensors = load_file(root / name)
    edit(tensors)
    save_file(tensors, str(root / name), metadata={"format": "pt"})


def test_missing_config_key(ckpt):
    d = json.loads((ckpt / "config.json").read_text())
    del d["num_hidden_layers"]
    (ckpt / "config.json").write_text(json.dumps(d))
    with pytest.raises(ModelError, match="missing required key 'num_hidden_layers'"):
        load_model(ckpt)


def test_missing_tensor(ckpt):
    rewrite_shard(ckpt, lambda t: t.pop("model.layers.0.self_attn.q_proj.weight"))
    with pytest.raises(ModelError, match=r"lacks 1 tensor\(s\): model.layers.0.self_attn.q_proj.weight"):
        load_model(ckpt)


def test_wrong_shape(ckpt):
    rewrite_shard(ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 63)}))
    with pytest.raises(ModelError, match=r"q_proj.weight' has shape \(64, 63\), expected \(64, 64\)"):
        load_model(ckpt)


def test_unexpected_tensor(ckpt):
    rewrite_shard(ckpt, lambda t: t.update({"model.layers.9.mlp.gate_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ModelError, match="unexpected tensor 'model.layers.9.mlp.gate_proj.weight'"):
        load_model(ckpt)


def test_missing_shard(ckpt):
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="shard 'model-00002-of-00002.safetensors' is missing"):
        load_model(ckpt)


def test_corrupt_safetensors(ckpt):
    path = ckpt / "model-00001-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelError, match="cannot read safetensors"):
        load_model(ckpt)


def test_missing_files_and_bad_json(tmp_path):
    with pytest.raises(ModelError, match="config.json does not exist"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf()))
    with pytest.raises(ModelError, match="has neither model.safetensors"):
        load_model(tmp_path)


def test_shard_count_is_checked_and_model_error_is_typed(tmp_path):
    with pytest.raises(ModelError, match="shards must be between 1 and"):
        make_random_checkpoint(tmp_path, CFG, shards=0)
    assert issubclass(ModelError, InvalidRequest) and issubclass(ModelError, KVTierError)
    assert ModelError.code == "invalid_request"
