"""The namespace of a checkpoint: geometry from its config.json, revision from a digest of its files.

Keys name token prefixes, not weights, so the namespace is what keeps KV of changed weights from
ever being served: its ``revision`` is :func:`checkpoint_digest`, a SHA-256 over the checkpoint's
weight files (and config.json, whose RoPE and norm settings change the KV too). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from kvtier_protocol.errors import NamespaceError
from kvtier_protocol.namespace import Namespace

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
"""Files of a checkpoint directory that hold weights (HF safetensors, PyTorch, GGUF)."""
DIGESTED_FILES = ("config.json",)
"""Other files whose content changes the KV: RoPE base and scaling, norm epsilon, activation."""
CHUNK_BYTES = 8 << 20
DIGEST_DOMAIN = b"kvtier-checkpoint-v1\x00"
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

_file_digests: dict[tuple[str, int, int], bytes] = {}
_lock = threading.Lock()


def _file_digest(path: Path) -> tuple[int, bytes]:
    """``(size, sha256)`` of one file, cached in-process by (path, size, mtime_ns)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _lock:
        cached = _file_digests.get(key)
    if cached is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
        cached = h.digest()
        with _lock:
            _file_digests[key] = cached
    return st.st_size, cached


def digested_files(model_dir: str | os.PathLike[str]) -> list[str]:
    """Names of the files :func:`checkpoint_digest` covers, sorted.

    Raises:
        NamespaceError: not a directory, or no weight file in it.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise NamespaceError(f"checkpoint directory {str(root)!r} does not exist")
    names = sorted(p.name for p in root.iterdir()
                   if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or p.name in DIGESTED_FILES))
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in names):
        raise NamespaceError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {str(root)!r}")
    return names


def checkpoint_digest(model_dir: str | os.PathLike[str]) -> str:
    """``"sha256:<hex>"`` over the checkpoint's weight files and config.json: names, sizes, contents.

    Each file is hashed in 8 MiB chunks once per process (cached by path, size and mtime), so a
    later call costs a ``stat`` per file. One changed byte in any weight gives another digest.

    Raises:
        NamespaceError: not a directory, or no weight file in it.
    """
    root = Path(model_dir)
    h = hashlib.sha256(DIGEST_DOMAIN)
    for name in digested_files(root):
        size, digest = _file_digest(root / name)
        encoded = name.encode()
        h.update(len(encoded).to_bytes(4, "little") + encoded + size.to_bytes(8, "little") + digest)
    return "sha256:" + h.hexdigest()


def _read_config(model_dir: Path) -> dict[str, Any]:
    if not model_dir.is_dir():
        raise NamespaceError(f"checkpoint directory {str(model_dir)!r} does not exist")
    try:
        with open(model_dir / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise NamespaceError(f"no config.json in {str(model_dir)!r}") from None
    except (OSError, ValueError) as exc:
        raise NamespaceError(f"cannot read {model_dir / 'config.json'}: {exc}") from None
    if not isinstance(config, dict):
        raise NamespaceError(f"{model_dir / 'config.json'} is not a JSON object")
    return config


def _positive(config: dict[str, Any], *names: str) -> int:
    """The first of ``names`` set to a positive int in the config."""
    for name in names:
        value = config.get(name)
        if type(value) is int and value > 0:
            return value
    raise NamespaceError(f"config.json has no positive integer {' or '.join(names)}")


def _kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    # Fewer KV heads than ranks: vLLM replicates each head over tp_size / H ranks, one per rank.
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return 1
    raise NamespaceError(f"{num_kv_heads} KV heads do not split over tp_size {tp_size}")


def geometry_from_config(config: dict[str, Any], *, tp_size: int = 1) -> dict[str, Any]:
    """Attention geometry of this TP rank's shard from an HF ``config.json`` map.

    MLA (DeepSeek-V2/V3, or any config with ``kv_lora_rank``): one latent of ``kv_lora_rank``
    dims plus ``qk_rope_head_dim`` RoPE dims per token, the same on every rank. MHA/GQA: KV heads
    divided over the TP ranks, head dim from ``head_dim`` or ``hidden_size / num_attention_heads``.

    Returns:
        The Namespace fields attention, num_layers, num_kv_heads, head_dim, head_dim_v, mla_rope_dim.

    Raises:
        NamespaceError: a needed field is missing or KV heads do not split over ``tp_size``.
    """
    num_layers = _positive(config, "num_hidden_layers", "num_layers", "n_layer")
    if config.get("model_type") in MLA_MODEL_TYPES or config.get("kv_lora_rank"):
        return {"attention": "mla", "num_layers": num_layers, "num_kv_heads": 1,
                "head_dim": _positive(config, "kv_lora_rank"), "head_dim_v": 0,
                "mla_rope_dim": _positive(config, "qk_rope_head_dim")}
    num_heads = _positive(config, "num_attention_heads", "n_head")
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    if type(num_kv_heads) is not int or num_kv_heads < 1:
        raise NamespaceError("config.json num_key_value_heads must be a positive integer")
    head_dim = config.get("head_dim")
    if not (type(head_dim) is int and head_dim > 0):
        hidden = _positive(config, "hidden_size", "n_embd")
        if hidden % num_heads:
            raise NamespaceError(f"hidden_size {hidden} is not a multiple of {num_heads} heads")
        head_dim = hidden // num_heads
    return {"attention": "mha", "num_layers": num_layers,
            "num_kv_heads": _kv_heads_per_rank(num_kv_heads, tp_size),
            "head_dim": head_dim, "head_dim_v": head_dim, "mla_rope_dim": 0}


def hash_tokens_for(block_tokens: int) -> int:
    """Tokens per hash unit of an engine whose KV pages hold ``block_tokens`` tokens: the page itself.

    The one rule every engine of a checkpoint follows, so that what one stores another finds:
    ``hash_tokens`` is part of the namespace and sets the chain of hashes that names a block,
    so two engines at block size 32 share KV only if both hash 32-token units. vLLM hashes its
    requests in units of ``hash_block_size``, which is its block size for a model with one
    KV-cache group (kvtier_vllm takes it from vLLM's ``KVCacheConfig``); SGLang hashes whole
    pages. The reference engine and kvtier_hf call this (through
    :func:`namespace_for_checkpoint`), so at every block size all of them meet in one namespace.
    """
    if type(block_tokens) is not int or block_tokens < 1:
        raise NamespaceError(f"block_tokens must be a positive integer, not {block_tokens!r}")
    return block_tokens


def namespace_for_checkpoint(model_dir: str | os.PathLike[str], *, kv_dtype: Any, block_tokens: int = 16,
                             hash_tokens: int | None = None, codec: str = "raw", tp_rank: int = 0, tp_size: int = 1,
                             tenant_salt: str = "", model: str | None = None) -> Namespace:
    """The namespace of KV computed with the checkpoint in ``model_dir``.

    Args:
        model_dir: an HF-format checkpoint directory (config.json + weight files).
        kv_dtype: the engine's KV dtype, a name (``"bfloat16"``) or a torch dtype.
        block_tokens: tokens per stored block (the engine's page size).
        hash_tokens: tokens per hash unit; default :func:`hash_tokens_for` ``(block_tokens)``,
            the rule every engine follows (set it only to match an engine that hashes otherwise).
        codec: how blocks are stored (``"raw"``, ``"int8"``, ...): part of the namespace, so a
            reader asking for raw KV never gets quantized KV.
        tp_rank, tp_size: this shard's tensor-parallel coordinate.
        tenant_salt: tenant isolation salt (``""``: none).
        model: the model id; default ``config.json``'s ``model_type`` (the weights are told
            apart by the revision, so copies of a checkpoint in other directories share KV).

    Raises:
        NamespaceError: an unreadable checkpoint or config, or invalid namespace fields.
    """
    if hash_tokens is None:
        hash_tokens = hash_tokens_for(block_tokens)
    root = Path(model_dir)
    config = _read_config(root)
    geometry = geometry_from_config(config, tp_size=tp_size)
    if model is None:
        model_type = config.get("model_type")
        model = model_type if isinstance(model_type, str) and model_type else "unknown"
    dtype = kv_dtype if isinstance(kv_dtype, str) else str(kv_dtype).removeprefix("torch.")
    return Namespace(model=model, revision=checkpoint_digest(root), kv_dtype=dtype, kv_codec=codec,
                     block_tokens=block_tokens, hash_tokens=hash_tokens, tp_rank=tp_rank, tp_size=tp_size,
                     tenant_salt=tenant_salt, **geometry)
