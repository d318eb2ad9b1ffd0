"""Rotary position embeddings, with Llama 3 frequency scaling (HF ``_compute_llama3_parameters``).

Two pairings of the rotated dims exist in the checkpoints we load:

- Llama ("half"): dim ``i`` pairs with ``i + d/2`` (HF ``rotate_half``);
- DeepSeek-V2 ("interleaved"): dim ``2i`` pairs with ``2i + 1`` (HF ``apply_rotary_emb`` on complex pairs).

cos/sin depend only on the position (elementwise ``cos``/``sin`` give the same bits whatever the
batch), so a token's rotation is identical in a prefill, a chunk or a decode step.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32, CPU), exactly as transformers computes them."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between
    # them interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for a set of positions; holds no weights, so it is not an ``nn.Module``."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict | None, *, interleaved: bool) -> None:
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self._inv_freq = inv_frequencies(rotary_dim, theta, scaling)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[N, rotary_dim // 2]`` float32, for ``positions [N]``."""
        inv_freq = self._by_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._by_device.setdefault(positions.device, self._inv_freq.to(positions.device))
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [N, H, rotary_dim]`` by the per-token angles; returns a new tensor of x's dtype."""
        cos = cos.to(x.dtype)[:, None, :]
        sin = sin.to(x.dtype)[:, None, :]
        if self.interleaved:
            even, odd = x[..., 0::2], x[..., 1::2]
            return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
        # Same operations as HF's q * cos + rotate_half(q) * sin, so the rotation is bit-identical.
        return torch.cat((first * cos + (-second) * sin, second * cos + first * sin), dim=-1)
