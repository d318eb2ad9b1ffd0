"""kvtier's reference engine: a small paged-KV Llama-family engine with prefix reuse through kvtier.

Files, in the order a request meets them (nano-vllm style, one main class each):

- ``engine.py`` — :class:`Engine`: ``generate()``, the step loop, loads and saves through the connector;
- ``scheduler.py`` — :class:`Sequence` and :class:`Scheduler`: chunked prefill, decode batches;
- ``cache.py`` — :class:`PageAllocator` (pages, ref counts, prefix sharing) and :class:`KVCache`;
- ``sampler.py`` — :class:`SamplingParams` and :class:`Sampler`;
- ``model.py``, ``attention.py``, ``mla.py``, ``layers.py``, ``rope.py`` — the model;
- ``checkpoint.py``, ``config.py`` — HF-format checkpoints and their config.

The names below are imported on first use, so ``import kvtier.engine.scheduler`` (bookkeeping
only) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "kvtier.engine.engine", "EngineStats": "kvtier.engine.engine", "Output": "kvtier.engine.engine",
    "SamplingParams": "kvtier.engine.sampler", "Sampler": "kvtier.engine.sampler",
    "Scheduler": "kvtier.engine.scheduler", "Sequence": "kvtier.engine.scheduler",
    "KVCache": "kvtier.engine.cache", "PageAllocator": "kvtier.engine.cache",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
