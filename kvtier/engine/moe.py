"""DeepSeek-V2 mixture-of-experts feed-forward: routed experts chosen per token, plus shared experts.

::

    scores  = softmax(x @ gate.weight.T)                         (float32, over n_routed_experts)
    top-k   = topk(scores, num_experts_per_tok)                  ("greedy"), or the top-k among the
              experts of the topk_group groups with the best expert ("group_limited_greedy")
    out     = sum over chosen e of experts[e](x) * score_e * routed_scaling_factor
              + shared_experts(x)                                (one SwiGLU, n_shared_experts wide)

Parameter names are the checkpoints' (``mlp.gate.weight``, ``mlp.experts.E.{gate,up,down}_proj
.weight``, ``mlp.shared_experts.*``), and the arithmetic follows transformers'
``DeepseekV2Moe`` step by step: the gate in float32 whatever the model dtype, each expert's
output scaled in float32 and cast back, summed in expert order. A token's result depends only
on the token: routing is per row, every GEMM a row-invariant :class:`Linear`, and the sum's
order is fixed by expert id, so a prefix loaded from kvtier still gives a recompute's logits.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.engine.config import ModelConfig
from kvtier.engine.layers import MLP, linear_rows


class MoEGate(nn.Module):
    """The router: ``weight [n_routed_experts, hidden]``, kept in float32 (as transformers keeps it)."""

    def __init__(self, config: ModelConfig, *, device=None) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.topk_method = config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, device=device,
                                               dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [N, k] float32, experts [N, k] int64)`` of the tokens ``x [N, hidden]``."""
        scores = linear_rows(x.float(), self.weight).softmax(dim=-1)
        if self.topk_method == "group_limited_greedy":
            assert self.n_group is not None and self.topk_group is not None, "checked by ModelConfig"
            grouped = scores.view(-1, self.n_group, self.num_experts // self.n_group)
            best = torch.topk(grouped.max(dim=-1).values, k=self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, best, True)
            scores = grouped.masked_fill(~keep[..., None], 0.0).view(-1, self.num_experts)
        weights, experts = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, experts


class MoE(nn.Module):
    """Routed experts (SwiGLU, ``moe_intermediate_size`` wide) and the optional shared experts."""

    def __init__(self, config: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.gate = MoEGate(config, device=device)
        self.experts = nn.ModuleList(MLP(config.hidden_size, config.moe_intermediate_size, **kw)
                                     for _ in range(config.n_routed_experts))
        self.shared_experts = (MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, **kw)
                               if config.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, hidden]`` -> ``[N, hidden]``."""
        weights, experts = self.gate(x)
        out = torch.zeros_like(x)
        # Expert by expert, in id order: each token's sum has the same order whatever the batch.
        for e in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == e)
            y = self.experts[e](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
