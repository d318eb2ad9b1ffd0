"""Model: a Llama-family decoder (GQA or DeepSeek-V2 MLA attention, dense or MoE feed-forward) that
runs on a paged KV cache.

Module and parameter names are HF's (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``,
``model.norm``, ``lm_head``), so ``Model.state_dict()`` has exactly the checkpoint's keys.
Weights are not initialised here: use :func:`kvtier.engine.checkpoint.load_model`.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.engine.attention import DEFAULT_CHUNK_TOKENS, Attention, AttnBatch, StepContext, sequence_spans
from kvtier.engine.config import ModelConfig
from kvtier.engine.layers import MLP, Embedding, Linear, RMSNorm, linear_rows
from kvtier.engine.mla import MLAttention
from kvtier.engine.moe import MoE
from kvtier.engine.rope import RotaryEmbedding
from kvtier_protocol.errors import InvalidRequest


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``; ``mlp`` is MoE in DeepSeek's MoE layers."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer: int, *, device=None,
                 dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        attention = MLAttention if config.is_mla else Attention
        self.self_attn = attention(config, rotary, **kw)
        self.mlp: nn.Module = (MoE(config, **kw) if config.is_moe_layer(layer)
                               else MLP(config.hidden_size, config.intermediate_size, **kw))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(self, h: torch.Tensor, step: StepContext, kv_cache: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), step, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    """HF's ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary, i, **kw) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)


class Model(nn.Module):
    """The decoder plus its LM head (or the embedding table, when tied).

    Attributes:
        config: the model's geometry.
        kv_block_layout: "vllm-flash" (MHA: a kvtier block is the stack over layers of
            ``cache[:, page]`` -> ``[L, 2, T, H_kv, D]``) or "mla-latent" (``[L, T, C]``).
        attn_chunk_tokens: keys per attention chunk; logits depend on it in the last bits, so
            engines that share KV must use the same value (the default).
    """

    def __init__(self, config: ModelConfig, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, attn_chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__()
        self.config = config
        self.kv_block_layout = "mla-latent" if config.is_mla else "vllm-flash"
        self.attn_chunk_tokens = attn_chunk_tokens
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling,
                                      interleaved=config.is_mla)
        self.model = Decoder(config, self.rotary, device=device, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, device=device, dtype=dtype)

    def kv_cache_shape(self, num_pages: int, block_tokens: int) -> tuple[int, ...]:
        """Shape of ONE layer's paged cache: MHA ``(2, P, T, H_kv, D)``; MLA ``(P, T, latent + rope)``."""
        c = self.config
        if c.is_mla:
            return (num_pages, block_tokens, c.kv_latent_dim)
        return (2, num_pages, block_tokens, c.num_kv_heads, c.head_dim)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                kv_caches: list[torch.Tensor], *, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step: write the new tokens' KV into the pages, attend, return logits.

        Args:
            input_ids: ``[N]`` int64, the new tokens of every sequence, concatenated.
            positions: ``[N]`` int64 RoPE positions (normally the cache index of each token).
            batch: the step's sequences (query/context lengths, block tables, slot mapping).
            kv_caches: one paged tensor per layer, shaped ``kv_cache_shape(P, batch.block_tokens)``.
            logits_rows: optional ``[M]`` row indices: compute logits for those tokens only
                (e.g. the last token of each sequence), skipping the LM head for the rest.

        Returns:
            float32 logits ``[N, vocab]`` (``[M, vocab]`` with ``logits_rows``).

        Raises:
            InvalidRequest: inconsistent batch, wrong number or shape of caches.
        """
        n = input_ids.shape[0]
        batch.check(n)
        self._check_caches(kv_caches, batch.block_tokens)
        if positions.shape != (n,):
            raise InvalidRequest(f"positions has shape {tuple(positions.shape)}, expected ({n},)")
        cos, sin = self.rotary.cos_sin(positions)
        step = StepContext(sequence_spans(batch, input_ids.device), batch.slot_mapping.to(input_ids.device),
                           cos, sin, self.attn_chunk_tokens)
        h = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, step, kv_cache)
        if logits_rows is not None:
            h = h.index_select(0, logits_rows.to(h.device))
        h = self.model.norm(h)
        head = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return linear_rows(h, head).float()

    def _check_caches(self, kv_caches: list[torch.Tensor], block_tokens: int) -> None:
        if len(kv_caches) != self.config.num_layers:
            raise InvalidRequest(f"{len(kv_caches)} KV caches for {self.config.num_layers} layers")
        num_pages = kv_caches[0].shape[0 if self.config.is_mla else 1] if kv_caches else 0
        expected = self.kv_cache_shape(num_pages, block_tokens)
        for i, cache in enumerate(kv_caches):
            if tuple(cache.shape) != expected:
                raise InvalidRequest(f"KV cache of layer {i} has shape {tuple(cache.shape)}, "
                                     f"expected {expected}")
