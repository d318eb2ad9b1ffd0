"""Sampling: greedy, or temperature with top-p, drawn from a seeded generator per request.

Each request owns a ``torch.Generator``, advanced only by its own draws, so a seeded request
samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Attributes:
        max_tokens: tokens to generate at most.
        temperature: 0 is greedy (argmax); otherwise logits are divided by it before softmax.
        top_p: sample from the smallest set of tokens whose probability reaches ``top_p``.
        seed: seeds the request's generator; None draws a fresh seed.
        stop_token_ids: generation stops after one of these (it is kept in the output).
        keep_logits: return the logits of every generated token (``Output.logits``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    keep_logits: bool = False

    def __post_init__(self) -> None:
        # ValueError, not assert: these come from users and `python -O` drops asserts.
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        """The request's generator, seeded with ``seed`` (or a fresh random seed)."""
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        return torch.Generator(device=device).manual_seed(seed)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the nucleus of ``probs`` (1-D) and renormalise.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``;
    the most likely token is always in it.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of the strictly more likely tokens
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


class Sampler:
    """Picks one token per row of a logits batch."""

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int]:
        """Sample the next token of each request.

        Args:
            logits: ``[B, vocab]`` float logits, one row per request.
            params: each row's sampling parameters.
            generators: each row's generator (unused, may be None, for greedy rows).

        Returns:
            One token id per row.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), "one row per request"
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, (p, g) in enumerate(zip(params, generators)):
            if p.greedy:
                out.append(greedy[i])
                continue
            assert g is not None, "a sampled row needs its generator"
            probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)
            probs = top_p_filter(probs, p.top_p)
            out.append(int(torch.multinomial(probs, 1, generator=g).item()))
        return out
