"""HF transformers ``DynamicCache`` <-> kvtier blocks: save a prompt prefix once, load it anywhere.

An HF decoder keeps, per layer, K and V as ``[batch, kv_heads, seq, head_dim]`` tensors, K after
RoPE (``apply_rotary_pos_emb`` runs before ``cache.update`` in every Llama-family attention), which
is also what vLLM and the reference engine keep in their pages. So one block of the canonical
layout holds exactly the same numbers whichever of them computed it, and a prefix saved by one
engine continues in another of the same namespace (same checkpoint, dtype, block size)::

    DynamicCache                                   canonical block b
    layers[l].keys   [1, H, S, D] --.              [L, 2, H, T, D]
    layers[l].values [1, H, S, D] --+-- tokens [b*T, (b+1)*T) of every layer, K then V

Only full blocks are stored, and a load leaves at least the prompt's last token to compute, since
the model needs one forward step to produce the next-token logits.

Supported: standard (full, unquantized) attention layers — Llama, Qwen, Mistral and the like.
A sliding-window or linear-attention layer keeps less than the whole prefix, so it is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtier_protocol.block import dtype_name, torch_dtype
from kvtier_protocol.errors import InvalidRequest, LayoutError, NamespaceError

if TYPE_CHECKING:
    from transformers import DynamicCache

    from kvtier.connector.core import KVConnectorCore
    from kvtier_protocol.keys import ExtraKeys
    from kvtier_protocol.namespace import Namespace

LAYOUT = "canonical"
"""The layout blocks travel in: HF keeps head-major K/V, the nearest of the stored layouts."""


def save_prefix(core: KVConnectorCore, token_ids: Sequence[int], cache: DynamicCache, *,
                extras: ExtraKeys | None = None) -> int:
    """Store the full blocks of ``token_ids`` whose K/V ``cache`` holds (batch 1).

    Blocks already stored are skipped before any tensor is built, so saving the same prompt
    again costs one lookup.

    Args:
        core: a connector core of the model's namespace (its codec is the one stored).
        token_ids: the prompt (or prompt + output) the cache was computed from, from position 0.
        cache: the model's cache after the forward pass over ``token_ids``.
        extras: extra hash keys (LoRA, multimodal items); the namespace's tenant salt by default.

    Returns:
        Blocks newly stored (0 when the daemon is down: the caller simply recomputes next time).

    Raises:
        LayoutError: the cache's geometry does not match the namespace, or a layer is not a
            full-attention layer.
        NamespaceError: the cache's dtype is not the namespace's kv_dtype.
        InvalidRequest: batch size other than 1.
    """
    ns: Namespace = core.ns
    block_tokens = ns.block_tokens
    keys, values = _layer_tensors(cache, ns)
    seq = keys[0].shape[-2]
    hashes = core.block_hashes(token_ids, extras)[: seq // block_tokens]
    if not hashes:
        return 0
    stored = core.lookup(hashes)
    if stored >= len(hashes):
        return 0
    # Build only the blocks the daemon lacks; the first of them names its parent in the chain.
    blocks = [_block(keys, values, b * block_tokens, (b + 1) * block_tokens, ns)
              for b in range(stored, len(hashes))]
    return core.store(hashes[stored:], blocks, layout=LAYOUT,
                      token_ids=list(token_ids[stored * block_tokens: len(hashes) * block_tokens]),
                      parent=hashes[stored - 1] if stored else None)


def load_prefix(core: KVConnectorCore, token_ids: Sequence[int], *, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None, config: Any = None,
                extras: ExtraKeys | None = None) -> tuple[DynamicCache | None, int]:
    """Load the longest stored prefix of ``token_ids`` as a ``DynamicCache`` to continue from.

    At most ``len(token_ids) - 1`` tokens are loaded (whole blocks), so the caller always runs
    the model on the rest — at least the last token — to get the next-token logits::

        cache, n = load_prefix(core, ids, device="cpu", dtype=torch.float32)
        out = model(input_ids=ids[None, n:], use_cache=True, **{cache_argument(model): cache})

    Args:
        core: a connector core of the model's namespace.
        token_ids: the prompt, from position 0.
        device: where the cache's tensors go (the model's device).
        dtype: the model's KV dtype; must be the namespace's kv_dtype (default: that dtype).
        config: the model's ``PretrainedConfig``; when given the cache's layer types come from it
            (as ``model.generate`` would build them) and are checked to be full attention.
        extras: extra hash keys; the namespace's tenant salt by default.

    Returns:
        ``(cache, tokens)``: the cache holding the first ``tokens`` tokens' K/V, or ``(None, 0)``
        on a miss (or when the daemon is down: the caller recomputes).

    Raises:
        NamespaceError: ``dtype`` is not the namespace's kv_dtype.
        LayoutError: ``config`` describes layers that are not full attention.
    """
    from transformers import DynamicCache

    ns: Namespace = core.ns
    kv_dtype = torch_dtype(ns.kv_dtype)
    if dtype is not None and dtype != kv_dtype:
        raise NamespaceError(f"the namespace holds {ns.kv_dtype} KV; the model asks for {dtype_name(dtype)}")
    usable = (len(token_ids) - 1) // ns.block_tokens  # the last token is always computed
    hashes = core.block_hashes(token_ids, extras)[:usable] if usable > 0 else []
    if not hashes:
        return None, 0
    # Two copies at memory bandwidth: the blocks out of the daemon's shared memory into one
    # staging tensor [n, L, 2, H, T, D], then one strided copy puts them side by side on the token
    # axis, [L, 2, H, n*T, D] (on the model's device), where every layer's K and V are contiguous
    # views, [1, H, n*T, D], as DynamicLayer keeps them. (torch.cat of the blocks on that axis
    # moves 4 KiB runs one tensor at a time: measured 4-6x slower than the two copies.)
    shape = _block_shape(ns)
    staging = torch.empty((len(hashes), *shape), dtype=kv_dtype)
    n = core.fetch_into(hashes, staging, layout=LAYOUT)
    if n == 0:
        return None, 0
    blocks = staging[:n].to(device)
    L, _, heads, t, dim = shape
    kv = torch.empty((L, 2, heads, n * t, dim), dtype=kv_dtype, device=blocks.device)
    kv.view(L, 2, heads, n, t, dim).copy_(blocks.permute(1, 2, 3, 0, 4, 5))
    data = [(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0)) for layer in range(ns.num_layers)]
    cache = DynamicCache(ddp_cache_data=data, config=config)
    _check_full_attention(cache.layers)
    return cache, n * ns.block_tokens


def cache_argument(model: Any) -> str:
    """The keyword ``model.forward`` takes its cache by: ``"cache"`` (transformers >= 5.2x, which
    deprecates the old name) or ``"past_key_values"`` (earlier releases)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _layer_tensors(cache: Any, ns: Namespace) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's K and V, checked against the namespace's geometry and dtype."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise LayoutError(f"{type(cache).__name__} has no per-layer K/V (need a transformers >= 4.56 Cache)")
    _check_full_attention(layers)
    if len(layers) != ns.num_layers:
        raise LayoutError(f"the cache has {len(layers)} layers; the namespace {ns.num_layers}")
    keys = [layer.keys for layer in layers]
    values = [layer.values for layer in layers]
    if any(k is None or v is None for k, v in zip(keys, values)):
        raise LayoutError("the cache has a layer that holds no K/V (run the model over the prompt first)")
    want_k = (ns.num_kv_heads, ns.head_dim)
    want_v = (ns.num_kv_heads, ns.head_dim_v)
    seq = keys[0].shape[-2] if keys[0].dim() == 4 else -1
    for i, (k, v) in enumerate(zip(keys, values)):
        if k.dim() != 4 or v.dim() != 4:
            raise LayoutError(f"layer {i}: K/V of rank {k.dim()}/{v.dim()}, expected [batch, heads, seq, dim]")
        if k.shape[0] != 1:
            raise InvalidRequest(f"layer {i}: batch of {k.shape[0]}; save one sequence at a time")
        if (k.shape[1], k.shape[3]) != want_k or (v.shape[1], v.shape[3]) != want_v:
            raise LayoutError(f"layer {i}: K {tuple(k.shape)} / V {tuple(v.shape)} do not match the "
                              f"namespace's {ns.num_kv_heads} heads x {ns.head_dim}/{ns.head_dim_v} dims")
        if k.shape[2] != seq or v.shape[2] != seq:
            raise LayoutError(f"layer {i} holds {k.shape[2]} tokens, layer 0 {seq}")
        if k.dtype != torch_dtype(ns.kv_dtype) or v.dtype != k.dtype:
            raise NamespaceError(f"layer {i}: {k.dtype} K/V in a {ns.kv_dtype} namespace")
    return keys, values


def _check_full_attention(layers: Sequence[Any]) -> None:
    for i, layer in enumerate(layers):
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise LayoutError(f"layer {i} ({type(layer).__name__}) does not keep the whole prefix's K/V")


def _block_shape(ns: Namespace) -> tuple[int, ...]:
    return (ns.num_layers, 2, ns.num_kv_heads, ns.block_tokens, ns.head_dim)


def _block(keys: list[torch.Tensor], values: list[torch.Tensor], start: int, end: int,
           ns: Namespace) -> torch.Tensor:
    """Tokens ``[start, end)`` of every layer as one canonical block ``[L, 2, H, T, D]`` (one copy)."""
    parts: list[torch.Tensor] = []
    for k, v in zip(keys, values):
        parts.append(k[0, :, start:end])
        parts.append(v[0, :, start:end])
    return torch.stack(parts).view(_block_shape(ns))
