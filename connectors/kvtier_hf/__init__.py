"""kvtier for HF transformers: save and load ``DynamicCache`` prompt prefixes of any decoder with
standard (full, unquantized) attention — Llama, Qwen, Mistral and the like.

:class:`HFPrefixCache` is the adapter (``for_model``, ``prefill``, ``save``, ``load``);
:func:`save_prefix` / :func:`load_prefix` / :func:`cache_argument` are the functions it is built on,
for callers that manage their own :class:`kvtier.connector.KVConnectorCore`. Importing this
package does not import transformers (``load`` does).
"""

from kvtier.connector.hf_cache import cache_argument, load_prefix, save_prefix
from kvtier_hf.prefix import HFPrefixCache, PrefillOutput

__all__ = ["HFPrefixCache", "PrefillOutput", "cache_argument", "load_prefix", "save_prefix"]
