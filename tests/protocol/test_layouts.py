"""Tests of kvtier_protocol.layouts: descriptors, engine-tensor mapping, exact conversions."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtier_protocol.errors import LayoutError
from kvtier_protocol.layouts import (LAYOUTS, Geometry, Layout, convert, convert_many, from_canonical,
                                     get_layout, to_canonical)

L, H, T, D, C = 2, 3, 4, 5, 7
MHA = Geometry(num_layers=L, num_tokens=T, num_heads=H, head_dim=D)
MLA = Geometry(num_layers=L, num_tokens=T, latent_dim=C)
MHA_NAMES = sorted(n for n, lay in LAYOUTS.items() if not lay.is_mla)
MLA_NAMES = sorted(n for n, lay in LAYOUTS.items() if lay.is_mla)


def canonical_block(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct values everywhere, so any misplaced element shows."""
    return torch.arange(L * 2 * H * T * D, dtype=torch.float32).reshape(L, 2, H, T, D).to(dtype)


def test_descriptors() -> None:
    assert get_layout("canonical").axes == ("layer", "kv", "head", "token", "dim")
    assert get_layout("vllm-nhc").shape_for(MHA) == (L, T, H, 2 * D)
    assert get_layout("vllm-hnc").shape_for(MHA) == (L, H, T, 2 * D)
    assert get_layout("vllm-flash").shape_for(MHA) == (L, 2, T, H, D)
    assert get_layout("sglang-page-first").shape_for(MHA) == (2, T, L, H, D)
    assert get_layout("sglang-page-first-direct").shape_for(MHA) == (2, L, T, H, D)
    assert get_layout("sglang-page-head").shape_for(MHA) == (2, H, T, L, D)
    assert get_layout("mla-latent").shape_for(MLA) == (L, T, C)
    assert get_layout("sglang-mla-page-first").shape_for(MLA) == (T, L, C)
    for lay in LAYOUTS.values():
        g = MLA if lay.is_mla else MHA
        shape = lay.shape_for(g)
        assert shape[lay.token_axis] == T
        assert lay.geometry_of(shape) == g
        assert get_layout(lay) is lay and get_layout(lay.name) is lay


@pytest.mark.parametrize("bad", ["", "CANONICAL", None, 3])
def test_unknown_layouts(bad: object) -> None:
    with pytest.raises(LayoutError):
        get_layout(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name,shape", [
    ("canonical", (L, 3, H, T, D)), ("canonical", (L, 2, H, T)), ("vllm-nhc", (L, T, H, 2 * D + 1)),
    ("canonical", (L, 2, 0, T, D)), ("mla-latent", (L, T)), ("vllm-flash", (L, 2, T, H, 1 << 32)),
])
def test_bad_shapes(name: str, shape: tuple) -> None:
    with pytest.raises(LayoutError):
        get_layout(name).geometry_of(shape)


def test_shape_for_needs_the_right_geometry() -> None:
    with pytest.raises(LayoutError):
        get_layout("canonical").shape_for(MLA)
    with pytest.raises(LayoutError):
        get_layout("mla-latent").shape_for(MHA)


@pytest.mark.parametrize("src,dst", list(itertools.product(MHA_NAMES, MHA_NAMES))
                         + list(itertools.product(MLA_NAMES, MLA_NAMES)))
def test_every_pair_round_trips_exactly(src: str, dst: str) -> None:
    if get_layout(src).is_mla:
        x = torch.randn(get_layout(src).shape_for(MLA), dtype=torch.float32).to(torch.bfloat16)
    else:
        x = from_canonical(torch.randn(L, 2, H, T, D).to(torch.bfloat16), src)
    y = convert(x, src, dst)
    assert y.is_contiguous() and y.shape == get_layout(dst).shape_for(MLA if get_layout(src).is_mla else MHA)
    assert torch.equal(convert(y, dst, src), x)
    assert torch.equal(to_canonical(y, dst), to_canonical(x, src))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.float16])
def test_conversion_is_bitwise_for_every_dtype(dtype: torch.dtype) -> None:
    bits = torch.arange(L * 2 * H * T * D, dtype=torch.int64).remainder(256).to(torch.uint8)
    x = bits.view(dtype) if dtype.itemsize == 1 else canonical_block(dtype)
    x = x.reshape(L, 2, H, T, D)
    for name in MHA_NAMES:
        assert torch.equal(to_canonical(from_canonical(x, name), name).view(torch.uint8),
                           x.view(torch.uint8))


@pytest.mark.parametrize("src,dst", [("canonical", "mla-latent"), ("mla-latent", "vllm-nhc")])
def test_mha_and_mla_do_not_mix(src: str, dst: str) -> None:
    x = torch.zeros(get_layout(src).shape_for(MLA if get_layout(src).is_mla else MHA))
    with pytest.raises(LayoutError):
        convert(x, src, dst)


def test_wrong_tensor_shape_for_layout() -> None:
    with pytest.raises(LayoutError):
        to_canonical(torch.zeros(L, 2, H, T, D), "vllm-nhc")


@pytest.mark.parametrize(("src", "dst"), [*itertools.product(MHA_NAMES, repeat=2),
                                        *itertools.product(MLA_NAMES, repeat=2)])
def test_convert_many_equals_convert_of_each_block(src: str, dst: str) -> None:
    g = MLA if get_layout(src).is_mla else MHA
    n = 3
    blocks = torch.arange(n * torch.Size(get_layout(src).shape_for(g)).numel(), dtype=torch.float32)
    blocks = blocks.reshape(n, *get_layout(src).shape_for(g))
    want = torch.stack([convert(b, src, dst) for b in blocks])
    got = convert_many(blocks, src, dst)
    assert got.is_contiguous() and torch.equal(got, want)
    view = convert_many(blocks, src, dst, contiguous=False)
    assert torch.equal(view, want)
    assert view.shape == (n, *get_layout(dst).shape_for(g))


def test_convert_many_checks_like_convert() -> None:
    with pytest.raises(LayoutError):
        convert_many(canonical_block().unsqueeze(0), "canonical", "mla-latent")
    with pytest.raises(LayoutError):
        convert_many(canonical_block(), "canonical", "vllm-flash")  # one block, not a stack of them
    with pytest.raises(LayoutError):
        convert_many(torch.zeros(()), "canonical", "vllm-flash")


def test_same_layout_returns_contiguous_equal_tensor() -> None:
    x = canonical_block()
    assert convert(x, "canonical", "canonical") is x
    strided = torch.zeros(L, 2, H, 2 * T, D)[:, :, :, ::2]
    assert convert(strided, "canonical", "canonical").is_contiguous()


# --- the layouts match what the engines hold ----------------------------------------------------
# Engine caches are filled element by element from K[l, h, t, d] / V[l, h, t, d] (no permutes), a
# block is sliced out as the connector would, and must equal the conversion of the canonical block.

def _kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x[:, 0], x[:, 1]


def _fill(cache: torch.Tensor, index, k: torch.Tensor, v: torch.Tensor) -> None:
    for l, h, t, d in itertools.product(range(L), range(H), range(T), range(D)):
        for part, src in ((0, k), (1, v)):
            cache[index(l, part, h, t, d)] = src[l, h, t, d]


NUM_BLOCKS, BLOCK = 3, 1  # the block under test is block 1 of 3; page p = 1


def test_vllm_standard_layouts_match_engine_pages() -> None:
    x = canonical_block()
    k, v = _kv(x)
    # vLLM >= 0.33: per layer [B, N, H, Dk+Dv] (LBNHC) and [B, H, N, Dk+Dv] (LBHNC).
    nhc = torch.zeros(L, NUM_BLOCKS, T, H, 2 * D)
    _fill(nhc, lambda l, p, h, t, d: (l, BLOCK, t, h, p * D + d), k, v)
    assert torch.equal(nhc[:, BLOCK], convert(x, "canonical", "vllm-nhc"))
    hnc = torch.zeros(L, NUM_BLOCKS, H, T, 2 * D)
    _fill(hnc, lambda l, p, h, t, d: (l, BLOCK, h, t, p * D + d), k, v)
    assert torch.equal(hnc[:, BLOCK], convert(x, "canonical", "vllm-hnc"))
    # A strided (non-contiguous) view straight out of the engine cache converts back exactly.
    assert torch.equal(to_canonical(nhc[:, BLOCK], "vllm-nhc"), x)
    assert torch.equal(to_canonical(hnc[:, BLOCK], "vllm-hnc"), x)


def test_vllm_legacy_layouts_match_engine_pages() -> None:
    x = canonical_block()
    k, v = _kv(x)
    # One cache tensor per layer: FlashAttention [2, B, N, H, D], FlashInfer [B, 2, N, H, D].
    flash = torch.zeros(L, 2, NUM_BLOCKS, T, H, D)
    _fill(flash, lambda l, p, h, t, d: (l, p, BLOCK, t, h, d), k, v)
    flashinfer = torch.zeros(L, NUM_BLOCKS, 2, T, H, D)
    _fill(flashinfer, lambda l, p, h, t, d: (l, BLOCK, p, t, h, d), k, v)
    flash, flashinfer = flash.unbind(0), flashinfer.unbind(0)
    want = convert(x, "canonical", "vllm-flash")
    assert torch.equal(torch.stack([c[:, BLOCK] for c in flash]), want)
    assert torch.equal(torch.stack([c[BLOCK] for c in flashinfer]), want)


def test_sglang_host_pool_layouts_match_pages() -> None:
    x = canonical_block()
    k, v = _kv(x)
    size = NUM_BLOCKS * T
    page_first = torch.zeros(2, size, L, H, D)
    _fill(page_first, lambda l, p, h, t, d: (p, BLOCK * T + t, l, h, d), k, v)
    assert torch.equal(page_first[:, BLOCK * T:(BLOCK + 1) * T], convert(x, "canonical", "sglang-page-first"))
    direct = torch.zeros(2, NUM_BLOCKS, L, T, H, D)
    _fill(direct, lambda l, p, h, t, d: (p, BLOCK, l, t, h, d), k, v)
    assert torch.equal(direct[:, BLOCK], convert(x, "canonical", "sglang-page-first-direct"))
    layer_first = torch.zeros(2, L, size, H, D)
    _fill(layer_first, lambda l, p, h, t, d: (p, l, BLOCK * T + t, h, d), k, v)
    assert torch.equal(layer_first[:, :, BLOCK * T:(BLOCK + 1) * T],
                       convert(x, "canonical", "sglang-page-first-direct"))
    page_head = torch.zeros(2, NUM_BLOCKS, H, T, L, D)
    _fill(page_head, lambda l, p, h, t, d: (p, BLOCK, h, t, l, d), k, v)
    assert torch.equal(page_head[:, BLOCK], convert(x, "canonical", "sglang-page-head"))


def test_mla_layouts_match_engine_pages() -> None:
    latent = torch.arange(L * T * C, dtype=torch.float32).reshape(L, T, C)
    vllm = torch.zeros(L, NUM_BLOCKS, 1, T, C)   # per layer [B, H=1, N, C]
    sglang = torch.zeros(NUM_BLOCKS * T, L, 1, C)  # host page_first [tokens, L, 1, C]
    direct = torch.zeros(NUM_BLOCKS, L, T, 1, C)   # host page_first_direct [pages, L, T, 1, C]
    for l, t, c in itertools.product(range(L), range(T), range(C)):
        vllm[l, BLOCK, 0, t, c] = latent[l, t, c]
        sglang[BLOCK * T + t, l, 0, c] = latent[l, t, c]
        direct[BLOCK, l, t, 0, c] = latent[l, t, c]
    assert torch.equal(vllm[:, BLOCK, 0], convert(latent, "mla-latent", "mla-latent"))
    assert torch.equal(direct[BLOCK, :, :, 0], latent)
    page = sglang[BLOCK * T:(BLOCK + 1) * T, :, 0]
    assert torch.equal(page, convert(latent, "mla-latent", "sglang-mla-page-first"))
    assert torch.equal(to_canonical(page, "sglang-mla-page-first"), latent)


def test_layout_is_a_frozen_value() -> None:
    lay = Layout("x", ("layer", "token", "latent"), "test")
    assert lay.is_mla and lay.canonical_name == "mla-latent"
    with pytest.raises(AttributeError):
        lay.name = "y"  # type: ignore[misc]
