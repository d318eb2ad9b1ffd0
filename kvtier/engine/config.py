"""ModelConfig: the geometry of a Llama-family decoder, read from and written to HF ``config.json``.

Two attention kinds share one config:

- ``"mha"`` — Llama GQA (``model_type`` ``"llama"``): ``num_kv_heads`` K/V heads of ``head_dim``;
- ``"mla"`` — DeepSeek-V2 multi-head latent attention (``model_type`` ``"deepseek_v2"``): each
  token caches a ``kv_lora_rank`` latent plus ``qk_rope_head_dim`` RoPE'd key dims. For MLA
  ``head_dim`` is the query/key head size ``qk_nope_head_dim + qk_rope_head_dim`` and
  ``num_kv_heads == num_heads`` (the latent is expanded to every head).

DeepSeek-V2 configs may declare MoE layers (``n_routed_experts``): layer ``i`` is MoE when
``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0`` (DeepSeek's and vLLM's rule;
transformers, which ignores ``moe_layer_freq``, agrees for the value 1 every released
checkpoint has), the others dense. Routing is DeepSeek-V2's: softmax scores, top-k
(``greedy`` or ``group_limited_greedy``), weights times ``routed_scaling_factor``, plus
``n_shared_experts`` always-on experts. ``norm_topk_prob`` true and a ``scoring_func`` other
than softmax are refused: DeepSeek-V2's own code has no sigmoid scoring, and for a normalised
top-k transformers (which ignores it), DeepSeek's code and vLLM each compute something else.

Torch-free, so the namespace and CLI code can read checkpoints without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtier_protocol.errors import InvalidRequest

MHA_MODEL_TYPES = ("llama",)
MLA_MODEL_TYPES = ("deepseek_v2",)
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

_REQUIRED = object()


class ModelError(InvalidRequest):
    """A checkpoint or model config the engine cannot run: bad config.json, missing or misshapen tensor.

    A subclass of InvalidRequest, so it crosses the wire with that code.
    """


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Geometry and numerics of one decoder; every field is what HF ``config.json`` says.

    Raises:
        ModelError: on inconsistent values (checked in ``__post_init__``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int                       # MLA: qk_nope_head_dim + qk_rope_head_dim
    rope_theta: float = 10000.0
    # None, or llama3: rope_type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    attention: str = "mha"              # "mha" | "mla"
    kv_lora_rank: int = 0               # MLA only, like the four below
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    n_routed_experts: int = 0           # MoE (MLA only): 0 = every layer dense
    num_experts_per_tok: int = 0        # top-k
    moe_intermediate_size: int = 0      # of each routed expert; shared: times n_shared_experts
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"         # "greedy" | "group_limited_greedy"
    n_group: int | None = None          # group_limited_greedy: expert groups, of which
    topk_group: int | None = None       # the top topk_group (by their best expert) are eligible
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check_positive(name, getattr(self, name))
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ModelError("rope_theta and rms_norm_eps must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.attention == "mha":
            if self.head_dim % 2:
                raise ModelError(f"head_dim {self.head_dim} must be even for RoPE")
        elif self.attention == "mla":
            self._check_mla()
        else:
            raise ModelError(f"attention must be 'mha' or 'mla', not {self.attention!r}")
        if self.n_routed_experts:
            self._check_moe()
        if self.rope_scaling is not None:
            # A private copy: the dataclass is frozen, the dict must not change under it either.
            object.__setattr__(self, "rope_scaling", _check_llama3(dict(self.rope_scaling)))

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _check_positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _check_positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ModelError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for RoPE")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ModelError(f"MLA head_dim must be qk_nope_head_dim + qk_rope_head_dim = "
                             f"{self.qk_nope_head_dim + self.qk_rope_head_dim}, not {self.head_dim}")
        if self.num_kv_heads != self.num_heads:
            raise ModelError("MLA expands its latent to every head: num_kv_heads must equal num_heads")

    def _check_moe(self) -> None:
        if not self.is_mla:
            raise ModelError("MoE layers are supported in DeepSeek-V2 (MLA) models only")
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_layer_freq"):
            _check_positive(name, getattr(self, name))
        for name in ("n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ModelError(f"{name} must be a non-negative integer, not {value!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ModelError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts "
                             f"{self.n_routed_experts}")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ModelError(f"routed_scaling_factor must be a positive number, not {self.routed_scaling_factor!r}")
        if self.topk_method == "group_limited_greedy":
            _check_positive("n_group", self.n_group)
            _check_positive("topk_group", self.topk_group)
            assert self.n_group is not None and self.topk_group is not None
            if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
                raise ModelError(f"group_limited_greedy needs n_group ({self.n_group}) to divide n_routed_experts "
                                 f"({self.n_routed_experts}) and topk_group ({self.topk_group}) <= n_group")
            if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
                raise ModelError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of "
                                 f"{self.topk_group} group(s)")
        elif self.topk_method != "greedy":
            raise ModelError(f"topk_method must be 'greedy' or 'group_limited_greedy', not {self.topk_method!r}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) is an MoE layer rather than a dense SwiGLU MLP."""
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def rotary_dim(self) -> int:
        """Dims of each query/key head that RoPE rotates."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_latent_dim(self) -> int:
        """MLA: values cached per token and layer (normalised latent, then RoPE'd key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        """Read an HF ``config.json`` map (``llama`` or ``deepseek_v2``, dense or MoE).

        Accepts both RoPE spellings: ``rope_theta`` + ``rope_scaling`` (transformers 4) and
        ``rope_parameters`` (transformers 5).

        Raises:
            ModelError: unsupported model type or feature, a missing required key, a wrong type.
        """
        if not isinstance(d, dict):
            raise ModelError("config.json must hold a JSON object")
        model_type = d.get("model_type")
        if model_type not in MHA_MODEL_TYPES + MLA_MODEL_TYPES:
            raise ModelError(f"config.json: unsupported model_type {model_type!r} "
                             f"(the engine runs {', '.join(MHA_MODEL_TYPES + MLA_MODEL_TYPES)})")
        _check_unsupported(d)
        num_heads = _int(d, "num_attention_heads")
        _check_positive("num_attention_heads", num_heads)  # before dividing by it below
        hidden_size = _int(d, "hidden_size")
        max_pos = _int(d, "max_position_embeddings", 2048)
        rope_theta, rope_scaling = _rope_from_hf(d, max_pos)
        common: dict[str, Any] = dict(
            vocab_size=_int(d, "vocab_size"), hidden_size=hidden_size,
            intermediate_size=_int(d, "intermediate_size"), num_layers=_int(d, "num_hidden_layers"),
            num_heads=num_heads, rope_theta=rope_theta, rope_scaling=rope_scaling,
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False), max_position_embeddings=max_pos)
        if model_type in MHA_MODEL_TYPES:
            head_dim = _int(d, "head_dim", None)
            if head_dim is None:
                head_dim = hidden_size // num_heads
            return cls(num_kv_heads=_int(d, "num_key_value_heads", num_heads), head_dim=head_dim, **common)
        nope, rope = _int(d, "qk_nope_head_dim"), _int(d, "qk_rope_head_dim")
        return cls(num_kv_heads=num_heads, head_dim=nope + rope, attention="mla",
                   kv_lora_rank=_int(d, "kv_lora_rank"), qk_rope_head_dim=rope, qk_nope_head_dim=nope,
                   v_head_dim=_int(d, "v_head_dim"), q_lora_rank=_int(d, "q_lora_rank", None),
                   **_moe_from_hf(d), **common)

    def to_hf(self) -> dict:
        """The HF ``config.json`` map that transformers loads as LlamaForCausalLM / DeepseekV2ForCausalLM.

        RoPE is written in the transformers-4 spelling (``rope_theta`` + ``rope_scaling``), which
        transformers 5 still reads. A dense MLA config declares no MoE (``first_k_dense_replace``
        equals the layer count, ``n_routed_experts`` is 0); an MoE one its experts and routing.
        """
        d: dict[str, Any] = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        }
        if not self.is_mla:
            d.update(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=self.head_dim)
            return d
        d.update(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                 kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
                 qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                 v_head_dim=self.v_head_dim)
        if not self.n_routed_experts:
            d.update(first_k_dense_replace=self.num_layers, n_routed_experts=0, n_shared_experts=0,
                     num_experts_per_tok=None, moe_intermediate_size=self.intermediate_size, topk_method="greedy")
            return d
        d.update(n_routed_experts=self.n_routed_experts, num_experts_per_tok=self.num_experts_per_tok,
                 moe_intermediate_size=self.moe_intermediate_size, n_shared_experts=self.n_shared_experts,
                 first_k_dense_replace=self.first_k_dense_replace, moe_layer_freq=self.moe_layer_freq,
                 topk_method=self.topk_method, n_group=self.n_group, topk_group=self.topk_group,
                 routed_scaling_factor=self.routed_scaling_factor, norm_topk_prob=False, scoring_func="softmax")
        return d


def _check_positive(name: str, value: Any) -> None:
    if type(value) is not int or value <= 0:
        raise ModelError(f"{name} must be a positive integer, not {value!r}")


def _check_llama3(s: dict) -> dict:
    if s.get("rope_type") != "llama3":
        raise ModelError(f"rope_scaling: only rope_type 'llama3' is supported, not {s.get('rope_type')!r}")
    missing = [k for k in LLAMA3_KEYS if k not in s]
    if missing:
        raise ModelError(f"rope_scaling (llama3) lacks {', '.join(missing)}")
    for key in LLAMA3_KEYS:
        value = s[key]
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (is_number and math.isfinite(value) and value > 0):
            raise ModelError(f"rope_scaling.{key} must be a positive number, not {value!r}")
    if s["high_freq_factor"] == s["low_freq_factor"]:
        raise ModelError("rope_scaling: high_freq_factor must differ from low_freq_factor")
    return s


def _get(d: dict, key: str, default: Any) -> Any:
    """``d[key]``; absent and null both mean "the default", as in transformers."""
    value = d.get(key)
    if value is not None:
        return value
    if default is _REQUIRED:
        raise ModelError(f"config.json: missing required key {key!r}")
    return default


def _int(d: dict, key: str, default: Any = _REQUIRED) -> Any:
    value = _get(d, key, default)
    if value is not None and type(value) is not int:
        raise ModelError(f"config.json: {key} must be an integer, not {value!r}")
    return value


def _float(d: dict, key: str, default: Any = _REQUIRED) -> float:
    value = _get(d, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelError(f"config.json: {key} must be a number, not {value!r}")
    return float(value)


def _bool(d: dict, key: str, default: Any = _REQUIRED) -> bool:
    value = _get(d, key, default)
    if type(value) is not bool:
        raise ModelError(f"config.json: {key} must be true or false, not {value!r}")
    return value


def _check_unsupported(d: dict) -> None:
    """Refuse features the engine does not implement rather than run them wrongly."""
    if d.get("hidden_act", "silu") != "silu":
        raise ModelError(f"config.json: hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ModelError(f"config.json: {key} is not supported")


def _moe_from_hf(d: dict) -> dict[str, Any]:
    """The MoE fields of a ``deepseek_v2`` config; none when ``n_routed_experts`` is absent, null or 0.

    Absent keys take DeepSeek's own defaults (no shared experts, ``moe_layer_freq`` 1, greedy
    routing, scale 1). Refuses the routing variants whose meaning differs between implementations.
    """
    routed = _int(d, "n_routed_experts", 0)
    if not routed:
        return {}
    if _get(d, "scoring_func", "softmax") != "softmax":
        raise ModelError(f"config.json: scoring_func {d.get('scoring_func')!r} is not supported for deepseek_v2 "
                         "(DeepSeek-V2 scores experts with softmax)")
    if _bool(d, "norm_topk_prob", False):
        raise ModelError("config.json: norm_topk_prob true is not supported (transformers ignores it, DeepSeek's "
                         "code and vLLM apply it differently; no DeepSeek-V2 checkpoint sets it)")
    return dict(n_routed_experts=routed, num_experts_per_tok=_int(d, "num_experts_per_tok"),
                moe_intermediate_size=_int(d, "moe_intermediate_size"), n_shared_experts=_int(d, "n_shared_experts", 0),
                first_k_dense_replace=_int(d, "first_k_dense_replace", 0), moe_layer_freq=_int(d, "moe_layer_freq", 1),
                topk_method=_get(d, "topk_method", "greedy"), n_group=_int(d, "n_group", None),
                topk_group=_int(d, "topk_group", None),
                routed_scaling_factor=_float(d, "routed_scaling_factor", 1.0))


def _rope_from_hf(d: dict, max_pos: int) -> tuple[float, dict | None]:
    """``(rope_theta, llama3 scaling or None)`` from either RoPE spelling."""
    theta = d.get("rope_theta")
    scaling = d.get("rope_scaling")
    params = d.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ModelError("config.json: rope_parameters must be one flat map "
                             "(per-layer RoPE is not supported)")
        theta = params.get("rope_theta", theta)
        scaling = params
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ModelError(f"config.json: rope_theta must be a number, not {theta!r}")
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ModelError(f"config.json: rope_scaling must be a map, not {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    out = {"rope_type": rope_type}
    out.update((k, scaling[k]) for k in LLAMA3_KEYS if k in scaling)
    # HF falls back to max_position_embeddings for a missing original length (standardize_rope_params).
    out.setdefault("original_max_position_embeddings", max_pos)
    return float(theta), _check_llama3(out)
