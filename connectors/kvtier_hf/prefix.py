"""Prompt prefixes of one HF transformers model in a kvtier daemon: :class:`HFPrefixCache`.

::

    from transformers import AutoModelForCausalLM
    from kvtier_hf import HFPrefixCache

    model = AutoModelForCausalLM.from_pretrained("/models/Llama-3.2-1B", dtype=torch.bfloat16)
    with HFPrefixCache.for_model(model) as kv:          # namespace from the checkpoint directory
        out = kv.prefill(prompt_ids)                       # loads the stored prefix, computes the rest,
        next_token = out.logits[0, -1].argmax()            # stores the new full blocks
        print(out.reused_tokens, out.saved_blocks)

The K/V moved are exactly the model's own (``DynamicCache`` layers, K after RoPE), stored as
canonical blocks of ``block_tokens`` tokens; the mechanics are :mod:`kvtier.connector.hf_cache`.
A daemon that is down only costs the reuse: ``prefill`` then computes the whole prompt.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier_protocol.block import dtype_name
from kvtier_protocol.errors import LayoutError, NamespaceError

from kvtier.connector import KVConnectorCore, namespace_for_checkpoint
from kvtier.connector.hf_cache import cache_argument, load_prefix, save_prefix


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    """What :meth:`HFPrefixCache.prefill` returns.

    Attributes:
        logits: the model's logits for the computed positions (``[1, n, vocab]``; the last row
            predicts the next token).
        cache: the ``DynamicCache`` over the whole prompt, to continue decoding from.
        reused_tokens: prompt tokens whose K/V were loaded instead of computed.
        saved_blocks: blocks newly stored after the forward pass.
    """

    logits: torch.Tensor
    cache: Any
    reused_tokens: int
    saved_blocks: int


class HFPrefixCache:
    """Save and load ``DynamicCache`` prefixes of one model (standard full attention).

    Args:
        core: a connector core of the model's namespace (see :meth:`for_model`); closed by
            :meth:`close`.
        model: the HF model (its device, dtype and config are used on load).
    """

    def __init__(self, core: KVConnectorCore, model: Any) -> None:
        self.core = core
        self.model = model

    @classmethod
    def for_model(cls, model: Any, checkpoint: str | os.PathLike[str] | None = None, *, address: str | None = None,
                  block_tokens: int = 16, codec: str = "raw", model_id: str | None = None, tenant_salt: str = "",
                  timeout_s: float = 2.0, token: str | None = None, accept_lossy: bool | None = None) -> HFPrefixCache:
        """A prefix cache for ``model``, its namespace read from the checkpoint directory.

        Args:
            model: a loaded HF decoder (Llama, Qwen, Mistral, ... with full attention).
            checkpoint: its HF-format checkpoint directory (config.json + weights), whose weight
                files are digested into the namespace; default ``model.name_or_path``.
            address: the daemon (``"unix:/path"`` or ``"tcp://host:port"``); default: the
                daemon's default socket.
            block_tokens: tokens per stored block (the hash unit: :func:`kvtier.connector.namespace.hash_tokens_for`).
            codec: how blocks are stored (``"raw"``, ``"int8"``, ...).
            model_id: model id in the namespace (default: config.json's ``model_type``).
            tenant_salt: tenant isolation salt.
            timeout_s: bound on each daemon call.
            token: the daemon's token (TCP).
            accept_lossy: False: exact copies only (a lossily re-encoded block is a miss); None:
                the daemon's default.

        Raises:
            NamespaceError: no checkpoint directory, or an unreadable one.
            LayoutError: an MLA model (its cache is not per-head K/V).
        """
        path = checkpoint if checkpoint is not None else getattr(model, "name_or_path", None)
        if not path or not os.path.isdir(path):
            raise NamespaceError(f"pass checkpoint=<local checkpoint directory>: {path!r} is not one, and the "
                                 "namespace needs the weights' digest")
        # hash_tokens by the rule every engine follows (hash_tokens_for): the reference engine and
        # vLLM at the same block size land in this namespace.
        ns = namespace_for_checkpoint(path, kv_dtype=dtype_name(model.dtype), block_tokens=block_tokens,
                                      codec=codec, tenant_salt=tenant_salt, model=model_id)
        if ns.attention != "mha":
            raise LayoutError(f"{ns.model} uses MLA; kvtier_hf saves per-head K/V caches only")
        return cls(KVConnectorCore(ns, address=address, timeout_s=timeout_s, token=token, accept_lossy=accept_lossy),
                   model)

    def save(self, token_ids: Sequence[int], cache: Any) -> int:
        """Store the full blocks of ``token_ids`` held by ``cache`` (batch 1); returns blocks newly
        stored (0 when the daemon is down). See :func:`kvtier.connector.hf_cache.save_prefix`."""
        return save_prefix(self.core, token_ids, cache)

    def load(self, token_ids: Sequence[int]) -> tuple[Any, int]:
        """The longest stored prefix of ``token_ids`` as a ``DynamicCache`` on the model's device,
        leaving at least the last token to compute; ``(None, 0)`` on a miss or outage.
        See :func:`kvtier.connector.hf_cache.load_prefix`."""
        return load_prefix(self.core, token_ids, device=self.model.device, dtype=self.model.dtype,
                           config=self.model.config)

    def prefill(self, token_ids: Sequence[int], **forward_kwargs: Any) -> PrefillOutput:
        """Run the model over ``token_ids``, reusing the stored prefix and storing the new blocks.

        Args:
            token_ids: the prompt (batch 1), from position 0.
            forward_kwargs: passed to ``model(...)`` (e.g. ``logits_to_keep=1``).
        """
        ids = list(token_ids)
        cache, reused = self.load(ids)
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids[reused:]], device=self.model.device), use_cache=True,
                             **{cache_argument(self.model): cache}, **forward_kwargs)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        return PrefillOutput(out.logits, cache, reused, self.save(ids, cache))

    def close(self) -> None:
        """Close the connector core (its daemon connections)."""
        self.core.close()

    def __enter__(self) -> HFPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
