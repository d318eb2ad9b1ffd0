"""Helpers of the connector tests: small namespaces and synthetic paged caches."""

from __future__ import annotations

import secrets

import torch

from kvtier.connector.pages import get_page_layout
from kvtier_protocol.block import torch_dtype
from kvtier_protocol.namespace import Namespace

LAYOUTS_OF = {"mha": ("vllm-flash", "vllm-nhc"), "mla": ("mla-latent",)}
CASES = [(att, layout, dtype) for att in ("mha", "mla") for layout in LAYOUTS_OF[att]
         for dtype in ("float32", "bfloat16")]
"""Every (attention, page layout, kv dtype) the core is tested with."""


def make_ns(attention: str = "mha", *, kv_dtype: str = "float32", codec: str = "raw", layers: int = 2,
            block_tokens: int = 4, hash_tokens: int | None = None, model: str | None = None) -> Namespace:
    """A small namespace; a fresh model name each call, so tests never see each other's blocks."""
    geometry = ({"num_kv_heads": 1, "head_dim": 12, "mla_rope_dim": 4} if attention == "mla"
                else {"num_kv_heads": 2, "head_dim": 8})
    return Namespace(model=model or f"test-{secrets.token_hex(6)}", revision="r1", attention=attention,
                     num_layers=layers, kv_dtype=kv_dtype, kv_codec=codec, block_tokens=block_tokens,
                     hash_tokens=hash_tokens or block_tokens, **geometry)


def make_caches(ns: Namespace, page_layout: str, num_pages: int = 8, *, seed: int | None = 0,
                device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer caches of ``num_pages`` pages: random normal values, or zeros with ``seed=None``."""
    shape = get_page_layout(page_layout).cache_shape(ns, num_pages)
    dtype = torch_dtype(ns.kv_dtype)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(ns.num_layers)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype=dtype, device=device) for _ in range(ns.num_layers)]


def tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids, deterministic per seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()
