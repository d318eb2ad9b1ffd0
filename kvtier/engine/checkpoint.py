"""HF-format checkpoints: load ``config.json`` + safetensors (one file or sharded), or write random ones.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or the shards named
in ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {tensor: file}}``), with
HF tensor names. Every problem with one (missing file or key, unknown tensor, wrong shape,
unreadable safetensors) raises :class:`ModelError` naming the file and tensor.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvtier.engine.config import ModelConfig, ModelError
from kvtier.engine.model import Model

__all__ = ["ModelError", "load_config", "load_model", "make_random_checkpoint", "weight_files"]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some HF checkpoints carry that the engine recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint directory's ``config.json``.

    Raises:
        ModelError: no such directory or file, invalid JSON, unsupported or incomplete config.
    """
    path = Path(model_dir) / CONFIG_FILE
    return ModelConfig.from_hf(_read_json(path))


def load_model(model_dir: str | os.PathLike[str], *, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> Model:
    """Build a :class:`Model` from an HF-format checkpoint directory, weights cast to ``dtype``.

    Raises:
        ModelError: a bad config, a missing/unexpected/misshapen tensor, an unreadable file.
    """
    config = load_config(model_dir)
    model = Model(config, device=device, dtype=dtype)
    expected = model.state_dict()
    loaded: set[str] = set()
    for path in weight_files(model_dir):
        for name, tensor in _read_tensors(path, expected, config):
            if name in loaded:
                raise ModelError(f"{path.name}: tensor {name!r} appears in more than one file")
            # Into the parameter's dtype: ``dtype``, but float32 for an MoE router (as transformers).
            expected[name].copy_(tensor)
            loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelError(f"checkpoint {str(model_dir)!r} lacks {len(missing)} tensor(s): {shown}")
    return model.eval()


def weight_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when sharded.

    Raises:
        ModelError: neither a single file nor an index, a bad index, or a shard it names is missing.
    """
    root = Path(model_dir)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{index_path}: no weight_map")
        names = sorted({str(v) for v in weight_map.values()})
        files = [root / name for name in names]
        for name, path in zip(names, files):
            if Path(name).name != name or not path.is_file():
                raise ModelError(f"{index_path}: shard {name!r} is missing")
        return files
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    raise ModelError(f"checkpoint {str(root)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def make_random_checkpoint(model_dir: str | os.PathLike[str], cfg: ModelConfig, *, seed: int = 0,
                           dtype: torch.dtype = torch.float32, shards: int = 1) -> None:
    """Write an HF-format checkpoint of ``cfg`` with fixed-seed random weights.

    The same arguments give byte-identical files. Weights keep activations O(1): every matrix
    ``[out, in]`` (embedding table included, as it may double as the LM head) ~ N(0, 1/in), so
    logits have a standard deviation near 1 whether tied or not; RMSNorm weights
    1 + N(0, 0.1^2) so that a misplaced norm shows. ``config.json`` loads in transformers as
    LlamaForCausalLM or DeepseekV2ForCausalLM.

    Raises:
        ModelError: ``shards`` is not between 1 and the number of tensors.
    """
    shapes = {name: t.shape for name, t in Model(cfg, device="meta").state_dict().items()}
    if not 1 <= shards <= len(shapes):
        raise ModelError(f"shards must be between 1 and {len(shapes)}, not {shards}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _random_tensor(name, shape, gen).to(dtype).contiguous()
               for name, shape in shapes.items()}
    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    config = cfg.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    _write_json(root / CONFIG_FILE, config)
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(root / SINGLE_FILE), metadata=metadata)
        return
    groups = _split_by_bytes(list(tensors), tensors, shards)
    weight_map = {}
    for i, names in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({name: tensors[name] for name in names}, str(root / file), metadata=metadata)
        weight_map.update((name, file) for name in names)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(root / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _random_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * noise
    return noise * shape[1] ** -0.5


def _split_by_bytes(names: list[str], tensors: dict[str, torch.Tensor], shards: int) -> list[list[str]]:
    """``shards`` non-empty runs of ``names``, in order, of roughly equal byte size."""
    ends = list(itertools.accumulate(tensors[n].numel() * tensors[n].element_size() for n in names))
    target = ends[-1] / shards
    cuts, start = [], 0
    for k in range(1, shards):
        # Close run k once it reaches k/shards of the bytes, leaving a tensor for each later run.
        cut = start + 1
        while cut < len(names) - (shards - k) and ends[cut - 1] < k * target:
            cut += 1
        cuts.append(cut)
        start = cut
    bounds = [0, *cuts, len(names)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def _read_tensors(path: Path, expected: dict[str, torch.Tensor], config: ModelConfig):
    """Yield ``(name, tensor)`` of one safetensors file, checking names and shapes before reading."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in expected:
                    tied_head = name == "lm_head.weight" and config.tie_word_embeddings
                    if name.endswith(_IGNORED_SUFFIXES) or tied_head:
                        continue
                    raise ModelError(f"{path.name}: unexpected tensor {name!r} for this config")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(expected[name].shape):
                    raise ModelError(f"{path.name}: tensor {name!r} has shape {shape}, "
                                     f"expected {tuple(expected[name].shape)}")
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelError(f"{path}: cannot read safetensors: {exc}") from None


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ModelError(f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read JSON: {exc}") from None


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
