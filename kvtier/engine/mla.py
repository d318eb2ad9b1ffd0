"""DeepSeek-V2 multi-head latent attention (MLA) over a paged cache of latents.

Per token and layer the cache holds only ``C = kv_lora_rank + qk_rope_head_dim`` values
(``kv_block_layout`` "mla-latent", one layer's cache ``[P pages, T tokens, C]``)::

    x -> kv_a_proj_with_mqa -> [ c (kv_lora_rank) | k_pe (qk_rope_head_dim) ]
         cache entry = [ kv_a_layernorm(c) | rope(k_pe) ]
    per head h:  k_h = [ kv_b_proj(c_norm)_h[:nope] | rope(k_pe) ]     (k_pe shared by all heads)
                 v_h =   kv_b_proj(c_norm)_h[nope:]
    q -> q_proj (or q_a_proj -> q_a_layernorm -> q_b_proj) -> per head [ q_nope | rope(q_pe) ]

Attention expands the gathered latents to per-head K/V with ``kv_b_proj`` (the "naive" form,
as in HF ``DeepseekV2Attention``) rather than absorbing ``kv_b_proj`` into the query: slower for
long decodes, but it follows the paper's equations line by line. RoPE pairs dims ``(2i, 2i + 1)``
as DeepSeek's checkpoints expect. The latent norms use eps 1e-6 whatever ``rms_norm_eps`` says,
as DeepSeek's and HF's code do. Exactness as in attention.py: the expansion is a row-invariant
Linear over the gathered context, so a token's K/V depend only on its cached latent.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.engine.attention import StepContext, causal_attention, gather_context, write_slots
from kvtier.engine.config import ModelConfig
from kvtier.engine.layers import Linear, RMSNorm
from kvtier.engine.rope import RotaryEmbedding

LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """MLA self-attention with DeepseekV2 parameter names."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, *, device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.kv_lora_rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.scale = self.qk_head_dim ** -0.5
        self.rotary = rotary
        hidden, h = config.hidden_size, config.num_heads
        kw = dict(device=device, dtype=dtype)
        self.q_lora_rank = config.q_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = Linear(hidden, h * self.qk_head_dim, **kw)
        else:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = Linear(config.q_lora_rank, h * self.qk_head_dim, **kw)
        self.kv_a_proj_with_mqa = Linear(hidden, config.kv_lora_rank + self.rope_dim, **kw)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = Linear(config.kv_lora_rank, h * (self.nope_dim + self.v_head_dim), **kw)
        self.o_proj = Linear(h * self.v_head_dim, hidden, **kw)

    def _query(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], self.num_heads, self.qk_head_dim)
        q_pe = self.rotary.apply(q[..., self.nope_dim:], step.cos, step.sin)
        return torch.cat((q[..., : self.nope_dim], q_pe), dim=-1)

    def _latent(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Cache entries ``[N, kv_lora_rank + rope_dim]`` of the new tokens."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = self.rotary.apply(k_pe.view(x.shape[0], 1, self.rope_dim), step.cos, step.sin)
        return torch.cat((self.kv_a_layernorm(c), k_pe.view(x.shape[0], self.rope_dim)), dim=-1)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head ``K [ctx, H, nope + rope]`` and ``V [ctx, H, v_head_dim]`` from cached latents."""
        ctx = latent.shape[0]
        c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c.contiguous()).view(ctx, self.num_heads, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(ctx, self.num_heads, self.rope_dim)), dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, step: StepContext, kv_cache: torch.Tensor) -> torch.Tensor:
        """``x [N, hidden]`` -> ``[N, hidden]``; writes the new latents into ``kv_cache [P, T, C]``."""
        n = x.shape[0]
        q = self._query(x, step)
        write_slots(kv_cache, step.slot_mapping, self._latent(x, step))
        out = q.new_empty(n, self.num_heads, self.v_head_dim)
        for span in step.spans:
            k, v = self._expand(gather_context(kv_cache, span).to(q.dtype))
            rows = slice(span.start, span.start + span.num_new)
            out[rows] = causal_attention(q[rows], k, v, q_start=span.q_start, scale=self.scale,
                                         chunk_tokens=step.chunk_tokens)
        return self.o_proj(out.view(n, self.num_heads * self.v_head_dim))
