"""Pages <-> blocks: gather and scatter are exact copies in every page layout, and the gathered
block is exactly the kvtier block layout the page layout names."""

from __future__ import annotations

import pytest
import torch

from kvtier.connector.pages import (PAGE_LAYOUTS, check_caches, gather_block, gather_blocks, get_page_layout,
                                    page_index, scatter_blocks)
from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.errors import InvalidRequest, LayoutError
from kvtier_protocol.layouts import convert, get_layout
from tests.kvtier.connector.connkit import CASES, make_caches, make_ns


def page(cache: torch.Tensor, layout: str, p: int) -> torch.Tensor:
    """Page ``p`` of one layer, spelled out per layout (the engines' own indexing)."""
    return cache[:, p] if layout == "vllm-flash" else cache[p]


@pytest.mark.parametrize(("attention", "layout", "dtype"), CASES)
def test_gather_stacks_one_page_of_every_layer(attention: str, layout: str, dtype: str) -> None:
    ns = make_ns(attention, kv_dtype=dtype)
    lay = get_page_layout(layout)
    caches = make_caches(ns, layout)
    block = gather_block(caches, 5, lay)
    assert torch.equal(block, torch.stack([page(c, layout, 5) for c in caches]))
    assert tuple(block.shape) == lay.block_shape(ns)
    get_layout(lay.block_layout).geometry_of(tuple(block.shape))  # a valid block of that layout
    index = page_index([5, 0, 7], 8, caches[0].device)
    batch = gather_blocks(caches, index, lay)
    assert batch.is_contiguous() and tuple(batch.shape) == (3, *lay.block_shape(ns))
    for got, p in zip(batch, (5, 0, 7)):
        assert torch.equal(got, gather_block(caches, p, lay))


@pytest.mark.parametrize(("attention", "layout", "dtype"), CASES)
def test_scatter_into_other_pages_is_bit_identical(attention: str, layout: str, dtype: str) -> None:
    ns = make_ns(attention, kv_dtype=dtype)
    lay = get_page_layout(layout)
    src, dst = make_caches(ns, layout, seed=1), make_caches(ns, layout, seed=None)
    blocks = gather_blocks(src, page_index([1, 3, 4], 8, torch.device("cpu")), lay)
    scatter_blocks(dst, page_index([6, 2, 0], 8, torch.device("cpu")), blocks, lay)
    for s, d in zip(src, dst):
        for a, b in ((1, 6), (3, 2), (4, 0)):
            assert page(s, layout, a).view(torch.uint8).equal(page(d, layout, b).view(torch.uint8))
        for untouched in (1, 3, 4, 5, 7):
            assert not page(d, layout, untouched).any()


@pytest.mark.parametrize(("attention", "layout", "dtype"), CASES)
def test_a_page_round_trips_through_a_record_and_converts_to_canonical(attention: str, layout: str,
                                                                       dtype: str) -> None:
    ns = make_ns(attention, kv_dtype=dtype)
    lay = get_page_layout(layout)
    caches, dst = make_caches(ns, layout, seed=2), make_caches(ns, layout, seed=None)
    block = gather_block(caches, 3, lay)
    record = encode_block(block, ns_id=ns.ns_id, chain_hash=bytes(32), parent_hash=None, layout=lay.block_layout)
    _, back = decode_block(record, layout=lay.block_layout)
    assert back.view(torch.uint8).equal(block.view(torch.uint8))
    scatter_blocks(dst, page_index([7], 8, torch.device("cpu")), back.unsqueeze(0), lay)
    assert all(torch.equal(page(c, layout, 3), page(d, layout, 7)) for c, d in zip(caches, dst))
    canonical = get_layout(lay.block_layout).canonical_name
    _, as_canonical = decode_block(record, layout=canonical)
    assert torch.equal(as_canonical, convert(block, lay.block_layout, canonical))


def test_cache_shapes_of_each_layout() -> None:
    mha, mla = make_ns("mha"), make_ns("mla")
    assert PAGE_LAYOUTS["vllm-flash"].cache_shape(mha, 8) == (2, 8, 4, 2, 8)
    assert PAGE_LAYOUTS["vllm-nhc"].cache_shape(mha, 8) == (8, 4, 2, 16)
    assert PAGE_LAYOUTS["mla-latent"].cache_shape(mla, 8) == (8, 4, 16)
    assert PAGE_LAYOUTS["mla-latent"].block_shape(mla) == (2, 4, 16)
    with pytest.raises(LayoutError):
        PAGE_LAYOUTS["vllm-flash"].page_shape(mla)
    with pytest.raises(LayoutError):
        PAGE_LAYOUTS["mla-latent"].page_shape(mha)
    with pytest.raises(LayoutError):
        get_page_layout("sglang-page-first")


def test_check_caches_refuses_what_does_not_fit_the_namespace() -> None:
    ns = make_ns("mha")
    lay = get_page_layout("vllm-flash")
    caches = make_caches(ns, "vllm-flash", 8)
    assert check_caches(caches, lay, ns) == 8
    with pytest.raises(LayoutError, match="layers"):
        check_caches(caches[:1], lay, ns)
    with pytest.raises(LayoutError, match="shape"):
        check_caches(make_caches(ns, "vllm-nhc", 8), lay, ns)
    with pytest.raises(LayoutError, match="namespace says"):
        check_caches([c.to(torch.bfloat16) for c in caches], lay, ns)
    with pytest.raises(LayoutError, match="layer 1"):
        check_caches([caches[0], caches[1].to(torch.bfloat16)], lay, ns)


def test_page_ids_are_checked() -> None:
    cpu = torch.device("cpu")
    assert page_index([2, 0], 4, cpu).tolist() == [2, 0]
    with pytest.raises(InvalidRequest, match="in \\[0, 4\\)"):
        page_index([4], 4, cpu)
    with pytest.raises(InvalidRequest, match="in \\[0, 4\\)"):
        page_index([-1], 4, cpu)
    with pytest.raises(InvalidRequest, match="distinct"):
        page_index([1, 1], 4, cpu)
