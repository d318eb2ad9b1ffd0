"""Small building blocks: row-invariant Linear, RMSNorm, SwiGLU MLP, token embedding.

The engine promises that a token's logits do not depend on what else is in the batch (a cached
prefix loaded from kvtier must give the logits of a full recompute). On CPU that rules out a few
kernels whose rounding depends on the tensor's size or an element's place in it:

- MKL's sgemm takes other code paths for few rows, and for a row count that leaves a thread a
  remainder of 1-3 rows (M = 1-3, 5-7, 9-11 rows with 2 threads; 17-19, 25-27 with 16), so a
  row's result changes with the batch size. :class:`Linear` pads the rows to a multiple of
  ``ROW_ALIGN``, at least ``MIN_GEMM_ROWS``; with that, a row's result was found identical for
  every row count up to 700 and 1 to 16 threads (MKL 2024.2, AVX2).
- ``torch.rsqrt``, ``torch.sigmoid`` and ``F.silu`` use a scalar formula for the tail of a tensor
  that is not a multiple of the vector width, which rounds differently from the vector formula. We
  use ``sqrt`` + division and ``x / (1 + exp(-x))``: sqrt and division are correctly rounded and
  ``exp`` gives the same bits in both paths. The results differ from HF's by an ulp at most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROW_ALIGN = 8
MIN_GEMM_ROWS = 16


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``, built from ops whose bits do not depend on the element's position."""
    return x / (1 + torch.exp(-x))


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x [N, in]``, with the rows padded so the GEMM path is size-independent."""
    n = x.shape[0]
    rows = max(MIN_GEMM_ROWS, -(-n // ROW_ALIGN) * ROW_ALIGN)
    if rows == n:
        return F.linear(x, weight)
    return F.linear(F.pad(x, (0, 0, 0, rows - n)), weight)[:n]


class Linear(nn.Module):
    """A bias-free linear layer (HF ``nn.Linear(..., bias=False)``; same ``weight`` name and shape)."""

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype=None) -> None:
        super().__init__()
        # Left uninitialised: weights always come from a checkpoint (or make_random_checkpoint).
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by ``weight`` in the input dtype (as HF)."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h / torch.sqrt(variance + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, device=device, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, device=device, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class Embedding(nn.Module):
    """Token embedding table ``[vocab, hidden]`` (HF ``embed_tokens``)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, device=device, dtype=dtype),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
