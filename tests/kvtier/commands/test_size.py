"""kvtier size: KV bytes per token (peers.md §7 figures), codec sizes and tokens per tier."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.commands import size
from kvtier.commands.size import KVGeometry, geometry_from_hf, tier_tokens
from kvtier_protocol.codec_plan import default_quant, section_lengths
from kvtier_protocol.namespace import Namespace

KIB = 1024
LLAMA_31_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
               "torch_dtype": "bfloat16"}
QWEN3_32B = {"num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 5120,
             "head_dim": 128, "torch_dtype": "bfloat16"}
LLAMA_3_70B = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192,
               "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128, "torch_dtype": "bfloat16"}
ENV_FREE = {"KVTIER_CONFIG": "", "KVTIER_HOST_BYTES": "", "KVTIER_DISK_BYTES": "", "KVTIER_GPU_BYTES": ""}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier")
    size.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["size", *argv])


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    args = parse(*argv, "--json")
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(autouse=True)
def _no_kvtier_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_FREE:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("cfg, per_token", [
    (LLAMA_31_8B, 128 * KIB), (QWEN3_32B, 256 * KIB), (LLAMA_3_70B, 320 * KIB),
    (DEEPSEEK_V3, 61 * (512 + 64) * 2),
])
def test_peers_figures(cfg: dict, per_token: int) -> None:
    assert geometry_from_hf(cfg).bytes_per_token() == per_token


def test_deepseek_v3_is_about_69_kib_per_token() -> None:
    assert round(geometry_from_hf(DEEPSEEK_V3).bytes_per_token() / KIB) == 69


def test_matches_the_namespace_formula() -> None:
    geo = KVGeometry(layers=28, kv_heads=4, head_dim=128, head_dim_v=64, rope_dim=0, dtype="float16", mla=False)
    ns = Namespace("m", "r", "mha", 28, 4, 128, head_dim_v=64, kv_dtype="float16")
    assert geo.bytes_per_token() == ns.bytes_per_token() == 28 * 4 * (128 + 64) * 2


def test_nested_text_config_tp_and_dtype() -> None:
    geo = geometry_from_hf({"text_config": LLAMA_31_8B, "vision_config": {}}, dtype="float32", tp=4)
    assert (geo.layers, geo.kv_heads, geo.head_dim, geo.dtype) == (32, 2, 128, "float32")
    assert geo.bytes_per_token() == 2 * 32 * 2 * 128 * 4


def test_codec_sizes_are_the_spec_section_lengths() -> None:
    geo = geometry_from_hf(LLAMA_31_8B)
    for codec in ("int8", "int4", "int2", "fp8_e4m3"):
        lengths = section_lengths(codec, default_quant(codec), (32, 2, 8, 16, 128), "bfloat16")
        assert geo.block_bytes(codec, 16) == sum(n for _, n in lengths)
    assert geo.block_bytes("raw", 16) == 16 * 128 * KIB
    assert geo.block_bytes("int4", 16) < geo.block_bytes("int8", 16) < geo.block_bytes("raw", 16)
    mla = geometry_from_hf(DEEPSEEK_V3)
    quant = default_quant("int8", mla=True, rope_dims=64)
    assert mla.block_bytes("int8", 64) == sum(n for _, n in section_lengths("int8", quant, (61, 64, 576), "bfloat16",
                                                                             True))


def test_tier_tokens_counts_whole_blocks() -> None:
    assert tier_tokens(10 * (2 << 20) + 5, 2 << 20, 16) == 160
    assert tier_tokens(100, 0, 16) == 0


def test_llama_8b_in_a_1_gib_host_tier(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_31_8B))
    r = run_json(capsys, "--model-config", str(path), "--tokens", "8192", "--host-bytes", "1GiB",
                 "--disk-bytes", "0", "--codec", "raw", "--codec", "int8")
    assert r["bytes_per_token"] == 128 * KIB and r["bytes_for_tokens"] == 1 << 30
    assert r["tiers"] == {"host": 1 << 30}
    raw, int8 = r["codecs"]
    assert raw["block_bytes"] == 2 << 20 and raw["tier_tokens"] == {"host": 8192}  # 512 blocks of 2 MiB
    assert int8["tier_tokens"]["host"] > raw["tier_tokens"]["host"]


def test_disk_and_gpu_tiers_come_from_the_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    conf = tmp_path / "kvtier.toml"
    conf.write_text('[store]\nhost_bytes = "64MiB"\ndisk_bytes = "1GiB"\ngpu_bytes = "128MiB"\n')
    r = run_json(capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--config", str(conf),
                 "--codec", "raw")
    assert r["tiers"] == {"gpu": 128 << 20, "host": 64 << 20, "disk": 1 << 30}
    tokens = r["codecs"][0]["tier_tokens"]
    assert tokens["host"] == 32 * 16 and tokens["gpu"] == 64 * 16
    header = size.record_header_bytes(KVGeometry(32, 8, 128, 128, 0, "bfloat16", False), "raw", 16)
    assert 100 < header < 400
    assert tokens["disk"] == (1 << 30) // ((2 << 20) + header) * 16 < 512 * 16


def test_mla_flags_and_all_codecs(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, "--layers", "61", "--mla-latent", "512", "--mla-rope", "64", "--codec", "all",
                 "--host-bytes", "1GiB")
    assert r["bytes_per_token"] == 61 * 576 * 2
    assert [c["codec"] for c in r["codecs"]] == ["raw", "int8", "int4", "int2", "fp8_e4m3"]
    assert all("error" not in c for c in r["codecs"])


def test_codecs_that_do_not_apply_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--head-dim-v", "32",
                 "--codec", "raw", "--codec", "int8", "--host-bytes", "1GiB")
    assert r["codecs"][0]["block_bytes"] == 16 * 2 * 2 * 96 * 2
    assert "d_v == d_k" in r["codecs"][1]["error"]
    r = run_json(capsys, "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--dtype", "fp8",
                 "--codec", "int4", "--host-bytes", "1GiB")
    assert r["geometry"]["dtype"] == "float8_e4m3fn" and "stored raw only" in r["codecs"][0]["error"]


def test_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tokens", "1000", "--host-bytes", "4GiB")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "KV per token: 131072 B (128 KiB)" in out and "host holds" in out and "int4" in out


@pytest.mark.parametrize("argv, match", [
    ((), "--model-config"),
    (("--layers", "32"), "--kv-heads"),
    (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "int3"), "dtype"),
    (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--codec", "zip"), "unknown codec"),
    (("--layers", "0", "--kv-heads", "8", "--head-dim", "128"), ">= 1"),
    (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--host-bytes", "huge"), "not a size"),
    (("--model-config", "/nonexistent/config.json"), "cannot read"),
])
def test_bad_input_exits_2_with_a_message(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                          match: str) -> None:
    args = parse(*argv)
    assert args.func(args) == 2
    assert match in capsys.readouterr().err


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    for flag in ("--layers", "--kv-heads", "--head-dim", "--dtype", "--tokens", "--mla-latent", "--mla-rope",
                 "--codec", "--model-config", "--config", "--host-bytes", "--json"):
        assert flag in out
