"""Codec parameters and section geometry (kvtier_protocol.codec_plan), without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier_protocol.codec_plan import CODECS, default_quant, plan_codec, section_lengths
from kvtier_protocol.errors import CodecError
from kvtier_protocol.quant import QuantParams

MHA = (4, 2, 8, 256, 128)


def test_module_does_not_import_torch() -> None:
    code = "import sys, kvtier_protocol.codec_plan; sys.exit('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd="protocol", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_defaults() -> None:
    assert default_quant("raw") is None
    assert default_quant("int8") == QuantParams(8, "channel", "token", 0, 0, "float16", 0)
    assert default_quant("int4") == QuantParams(4, "channel", "token", 32, 32, "float16", 0)
    assert default_quant("int2") == QuantParams(2, "channel", "token", 32, 32, "float16", 0)
    assert default_quant("fp8_e4m3") == QuantParams(8, "channel", "token", 0, 0, "float32", 0)
    mla = QuantParams(4, "token", "token", 128, 128, "float16", 64)
    assert default_quant("int4", mla=True, rope_dims=64) == mla
    assert default_quant("fp8_e4m3", mla=True).scale_dtype == "float32"
    with pytest.raises(CodecError):
        default_quant("zstd")


@pytest.mark.parametrize(
    ("codec", "expected"),
    [
        ("raw", [("payload", 4194304)]),
        # K per channel over 256 tokens: 8*128 stats per layer; V per token: 8*256 stats per layer.
        ("int8", [("payload", 2097152), ("scales", 4 * (1024 + 2048) * 2), ("mins", 4 * (1024 + 2048) * 2)]),
        # g=32: K 8 heads * 8 groups * 128 ch; V 8 heads * 256 tokens * 4 groups -> 8192 each.
        ("int4", [("payload", 1048576), ("scales", 4 * 16384 * 2), ("mins", 4 * 16384 * 2)]),
        ("int2", [("payload", 524288), ("scales", 4 * 16384 * 2), ("mins", 4 * 16384 * 2)]),
        ("fp8_e4m3", [("payload", 2097152), ("scales", 4 * 2 * 8 * 4)]),
    ],
)
def test_section_lengths_mha(codec: str, expected: list[tuple[str, int]]) -> None:
    assert section_lengths(codec, default_quant(codec), MHA, "bfloat16") == expected


@pytest.mark.parametrize(("codec", "tokens", "bits_per_elem"), [
    ("int8", 256, 8.1875), ("int8", 16, 9.125), ("int4", 256, 5.0), ("int4", 16, 5.5),
    ("int2", 256, 3.0), ("fp8_e4m3", 256, 8.0), ("raw", 256, 16.0),
])
def test_effective_bits(codec: str, tokens: int, bits_per_elem: float) -> None:
    """The SPEC §5 table: bits per element with default parameters, D=128, float16 scales."""
    shape = (2, 2, 4, tokens, 128)
    total = sum(n for _, n in section_lengths(codec, default_quant(codec), shape, "bfloat16"))
    assert total * 8 / (2 * 2 * 4 * tokens * 128) == pytest.approx(bits_per_elem, abs=1e-3)


def test_mla_lengths_with_rope() -> None:
    q = default_quant("int4", mla=True, rope_dims=64)
    # DeepSeek-like latent: 512 quantized dims in 4 groups of 128, 64 rope dims raw.
    assert section_lengths("int4", q, (2, 16, 576), "bfloat16", mla=True) == [
        ("payload", 2 * 16 * 256), ("scales", 2 * 16 * 4 * 2), ("mins", 2 * 16 * 4 * 2),
        ("rope", 2 * 16 * 64 * 2)]
    q8 = default_quant("fp8_e4m3", mla=True, rope_dims=64)
    # FlashMLA-like: 512 fp8 + 4 fp32 scales + 64 bf16 rope = 656 bytes per token.
    lengths = section_lengths("fp8_e4m3", q8, (1, 1, 576), "bfloat16", mla=True)
    assert lengths == [("payload", 512), ("scales", 16), ("rope", 128)]
    assert sum(n for _, n in lengths) == 656


def test_ragged_and_oversized_groups() -> None:
    q = QuantParams(4, "channel", "token", 32, 32, "float16", 0)
    plan = plan_codec("int4", q, (1, 2, 2, 48, 40), "float16")
    assert plan.groups == ((2, 32), (3, 32))
    assert plan.stats_shape(0) == (1, 2, 2, 40)  # 48 tokens: a group of 32 and a ragged one of 16
    assert plan.stats_shape(1) == (1, 2, 48, 2)  # 40 channels: 32 + 8
    small = plan_codec("int4", q, (1, 2, 2, 16, 8), "float16")
    assert small.groups == ((2, 16), (3, 8))  # a group longer than its axis covers the axis


def test_odd_row_is_padded_to_a_byte() -> None:
    q = QuantParams(2, "token", "token", 0, 0, "float32", 0)
    assert section_lengths("int2", q, (1, 2, 1, 3, 5), "float32")[0] == ("payload", 1 * 2 * 1 * 3 * 2)


@pytest.mark.parametrize(("codec", "quant", "shape", "dtype", "mla"), [
    ("lz4", None, MHA, "bfloat16", False),
    ("raw", None, MHA, "complex64", False),
    ("raw", None, (4, 3, 8, 256, 128), "bfloat16", False),  # kv axis must be 2
    ("raw", None, (4, 2, 8, 256), "bfloat16", False),
    ("raw", None, (4, 2, 0, 256, 128), "bfloat16", False),
    ("raw", None, (4, 2, True, 256, 128), "bfloat16", False),
    ("raw", None, (4, 256, 128, 1), "bfloat16", True),
    ("raw", default_quant("int8"), MHA, "bfloat16", False),
    ("int8", None, MHA, "bfloat16", False),
    ("int8", default_quant("int8"), MHA, "int8", False),
    ("int8", default_quant("int4"), MHA, "bfloat16", False),
    ("int4", QuantParams(4, k_group=3), MHA, "bfloat16", False),
    ("int2", QuantParams(2, v_group=6), MHA, "bfloat16", False),
    ("int4", QuantParams(4, rope_dims=8), MHA, "bfloat16", False),
    ("int4", QuantParams(4, "token", rope_dims=64), (1, 4, 64), "bfloat16", True),
    ("fp8_e4m3", QuantParams(8, scale_dtype="float16"), MHA, "bfloat16", False),
    ("fp8_e4m3", QuantParams(8, "channel", scale_dtype="float32"), (1, 4, 64), "bfloat16", True),
])
def test_invalid_parameters(codec: str, quant: QuantParams | None, shape: tuple, dtype: str,
                            mla: bool) -> None:
    with pytest.raises(CodecError):
        section_lengths(codec, quant, shape, dtype, mla)


def test_codec_names() -> None:
    assert CODECS == ("raw", "int8", "int4", "int2", "fp8_e4m3")
