"""GQA attention over a paged KV cache, and the batch description one forward step runs on.

Paged cache of one layer (``kv_block_layout`` "vllm-flash")::

    cache[0] = K, cache[1] = V:  [P pages, T tokens per page, H_kv heads, D]
    slot s = page_id * T + offset   (AttnBatch.slot_mapping holds one slot per new token)

A step writes the new tokens' K/V at their slots first, then, per sequence, gathers its context
(``context_lens[i]`` tokens through ``block_tables[i]``) and runs causal attention of its new
tokens over it. New tokens therefore read their own K/V back from the cache, exactly as a later
step (or another process that loaded the pages from kvtier) would.

Exactness: :func:`causal_attention` walks the context in fixed chunks of ``chunk_tokens`` keys
that start at absolute cache index 0, keeps an online softmax, and computes every score and
partial sum with a GEMM whose K dimension is fixed (head dim, chunk size) and whose row count is a
multiple of ``ROW_TILE`` tokens. Chunks past a query's own position are fully masked and change
nothing (they add exact zeros and rescale by exactly 1). So a query's output depends only on its
position and the K/V values: whole-prompt prefill, chunked prefill and decode give the same bits
on CPU, as long as the BLAS computes a row of a GEMM the same way for every row count that is a
multiple of 16 (verified for MKL 2024.2 with 1, 2, 3 and 16 threads; see layers.py). On CUDA,
cuBLAS picks kernels by shape, so only closeness (about 1e-6 relative) is to be expected there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.config import ModelConfig
from kvtier.engine.layers import Linear
from kvtier.engine.rope import RotaryEmbedding
from kvtier_protocol.errors import InvalidRequest

ROW_TILE = 16               # query tokens are padded to a multiple of this (see module docstring)
DEFAULT_CHUNK_TOKENS = 64   # keys per attention chunk (64 measured faster than 128 or 256 on CPU)


@dataclass(slots=True)
class AttnBatch:
    """One forward step over several sequences; their new tokens are concatenated in this order."""

    query_lens: list[int]          # new tokens of each sequence in this step (sum = N)
    context_lens: list[int]        # tokens of each sequence in the cache AFTER this step (cached + new)
    block_tables: list[list[int]]  # page ids of each sequence, in order
    slot_mapping: torch.Tensor     # [N] int64: page_id * block_tokens + offset of each new token's K/V
    block_tokens: int              # tokens per page

    def check(self, num_tokens: int) -> None:
        """Raise InvalidRequest unless the batch describes ``num_tokens`` new tokens consistently."""
        if not (len(self.query_lens) == len(self.context_lens) == len(self.block_tables)):
            raise InvalidRequest("AttnBatch: query_lens, context_lens and block_tables differ in length")
        if self.block_tokens <= 0:
            raise InvalidRequest(f"AttnBatch: block_tokens must be positive, not {self.block_tokens}")
        if sum(self.query_lens) != num_tokens or self.slot_mapping.shape != (num_tokens,):
            raise InvalidRequest(f"AttnBatch: query_lens sum to {sum(self.query_lens)} and slot_mapping "
                                 f"has shape {tuple(self.slot_mapping.shape)}, but the step has "
                                 f"{num_tokens} tokens")
        for i, (q, c, table) in enumerate(zip(self.query_lens, self.context_lens, self.block_tables)):
            if not 0 <= q <= c:
                raise InvalidRequest(f"AttnBatch: sequence {i} has query_len {q} > context_len {c}")
            if len(table) * self.block_tokens < c:
                raise InvalidRequest(f"AttnBatch: sequence {i} has {len(table)} pages for {c} tokens")


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """Where one sequence's new tokens sit in the step, and the pages holding its context."""

    start: int            # first row of its new tokens in the step's [N, ...] tensors
    num_new: int          # query_len
    context_len: int      # cached + new
    pages: torch.Tensor   # [ceil(context_len / T)] int64 page ids

    @property
    def q_start(self) -> int:
        """Cache index (= position in the sequence) of the first new token."""
        return self.context_len - self.num_new


@dataclass(slots=True)
class StepContext:
    """What every layer needs in one forward step, computed once by the model."""

    spans: list[SeqSpan]
    slot_mapping: torch.Tensor
    cos: torch.Tensor          # [N, rotary_dim // 2] float32
    sin: torch.Tensor
    chunk_tokens: int


def sequence_spans(batch: AttnBatch, device: torch.device) -> list[SeqSpan]:
    """The non-empty sequences of ``batch`` as spans, page ids already on ``device``."""
    spans, start = [], 0
    for q, c, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
        if q:
            num_pages = -(-c // batch.block_tokens)
            pages = torch.tensor(table[:num_pages], dtype=torch.int64, device=device)
            spans.append(SeqSpan(start, q, c, pages))
        start += q
    return spans


def write_slots(cache_part: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Store ``values [N, ...]`` at ``slots`` of a paged tensor ``[P, T, ...]`` (in place)."""
    cache_part.view(-1, *cache_part.shape[2:]).index_copy_(0, slots, values.to(cache_part.dtype))


def gather_context(cache_part: torch.Tensor, span: SeqSpan) -> torch.Tensor:
    """The first ``span.context_len`` tokens of a paged tensor ``[P, T, ...]`` -> ``[ctx, ...]``."""
    return cache_part.index_select(0, span.pages).flatten(0, 1)[: span.context_len]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int, scale: float,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Causal attention of ``n`` new tokens over a sequence's whole context.

    Args:
        q: ``[n, Hq, Dk]``; query ``i`` sits at cache index ``q_start + i``.
        k: ``[ctx, Hkv, Dk]`` with ``ctx = q_start + n``; ``Hq`` a multiple of ``Hkv`` (GQA).
        v: ``[ctx, Hkv, Dv]``.
        q_start: cached tokens before the first query.
        scale: score scale (``1/sqrt(Dk)``).
        chunk_tokens: keys per chunk; results depend on it in the last bits, so keep it fixed.

    Returns:
        ``[n, Hq, Dv]`` in q's dtype; computed in float32.
    """
    n, hq, dk = q.shape
    ctx, hkv, dv = v.shape
    assert k.shape[0] == ctx == q_start + n, f"context {ctx} != {q_start} cached + {n} new"
    g = hq // hkv
    n_pad = -(-n // ROW_TILE) * ROW_TILE
    ctx_pad = -(-ctx // chunk_tokens) * chunk_tokens
    # Rows of each KV head are (token, query head of its group), token-major, so the tokens that
    # may see a chunk form a suffix of the rows.
    qh = F.pad(q.float(), (0, 0, 0, 0, 0, n_pad - n)).view(n_pad, hkv, g, dk)
    qh = qh.permute(1, 0, 2, 3).reshape(hkv, n_pad * g, dk)
    kh = F.pad(k.float(), (0, 0, 0, 0, 0, ctx_pad - ctx)).permute(1, 0, 2).contiguous()
    vh = F.pad(v.float(), (0, 0, 0, 0, 0, ctx_pad - ctx)).permute(1, 0, 2).contiguous()
    q_pos = (q_start + torch.arange(n_pad, device=q.device)).repeat_interleave(g)[:, None]
    key_offsets = torch.arange(chunk_tokens, device=q.device)[None, :]

    qh = qh * scale
    rows = n_pad * g
    m = torch.full((hkv, rows, 1), float("-inf"), dtype=torch.float32, device=q.device)  # running max
    l = torch.zeros((hkv, rows, 1), dtype=torch.float32, device=q.device)  # running sum of exp
    acc = torch.zeros((hkv, rows, dv), dtype=torch.float32, device=q.device)  # running sum of exp * V
    for c0 in range(0, ctx_pad, chunk_tokens):
        # Skip the row tiles whose tokens all precede this chunk; whole tiles keep GEMMs row-invariant.
        t0 = max(0, c0 - q_start) // ROW_TILE * ROW_TILE
        r0 = t0 * g
        s = torch.bmm(qh[:, r0:], kh[:, c0:c0 + chunk_tokens].transpose(1, 2))
        if c0 + chunk_tokens - 1 > q_start + t0:  # some key of the chunk lies after some query
            s.masked_fill_(key_offsets + c0 > q_pos[r0:], float("-inf"))
        m_new = torch.maximum(m[:, r0:], s.amax(-1, keepdim=True))
        p = s.sub_(m_new).exp_()
        alpha = torch.exp(m[:, r0:] - m_new)
        l[:, r0:].mul_(alpha).add_(p.sum(-1, keepdim=True))
        acc[:, r0:].mul_(alpha).add_(torch.bmm(p, vh[:, c0:c0 + chunk_tokens]))
        m[:, r0:] = m_new
    out = (acc / l).view(hkv, n_pad, g, dv).permute(1, 0, 2, 3).reshape(n_pad, hq, dv)
    return out[:n].to(q.dtype)


class Attention(nn.Module):
    """Llama GQA self-attention (HF names: q_proj, k_proj, v_proj, o_proj) over a paged cache."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, *, device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.rotary = rotary
        hidden, h, hkv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = Linear(hidden, h * d, device=device, dtype=dtype)
        self.k_proj = Linear(hidden, hkv * d, device=device, dtype=dtype)
        self.v_proj = Linear(hidden, hkv * d, device=device, dtype=dtype)
        self.o_proj = Linear(h * d, hidden, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, step: StepContext, kv_cache: torch.Tensor) -> torch.Tensor:
        """``x [N, hidden]`` -> ``[N, hidden]``; writes the new K/V into ``kv_cache [2, P, T, Hkv, D]``."""
        n = x.shape[0]
        q = self.rotary.apply(self.q_proj(x).view(n, self.num_heads, self.head_dim), step.cos, step.sin)
        k = self.rotary.apply(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), step.cos, step.sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        write_slots(kv_cache[0], step.slot_mapping, k)
        write_slots(kv_cache[1], step.slot_mapping, v)
        out = q.new_empty(n, self.num_heads, self.head_dim)
        for span in step.spans:
            k_ctx = gather_context(kv_cache[0], span).to(q.dtype)
            v_ctx = gather_context(kv_cache[1], span).to(q.dtype)
            rows = slice(span.start, span.start + span.num_new)
            out[rows] = causal_attention(q[rows], k_ctx, v_ctx, q_start=span.q_start, scale=self.scale,
                                         chunk_tokens=step.chunk_tokens)
        return self.o_proj(out.view(n, self.num_heads * self.head_dim))
