"""Quantization parameters recorded in a block header (SPEC.md §5). Torch-free.

The codecs themselves live in :mod:`kvtier_protocol.codecs`; this module only describes their
parameters so that the header can be decoded and validated without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier_protocol.errors import HeaderError

AXES = ("channel", "token")
"""``channel``: one scale per channel, reduced over tokens (KIVI's K); ``token``: one scale per
token, reduced over channels (KIVI's V)."""

SCALE_DTYPES = ("float16", "float32")


@dataclass(frozen=True, slots=True)
class QuantParams:
    """How a quantized block was encoded.

    Attributes:
        bits: code width: 8, 4 or 2 for the integer codecs, 8 for fp8.
        k_axis: ``"channel"`` or ``"token"``: what one K scale covers (see :data:`AXES`).
        v_axis: the same for V.
        k_group: group size along the reduced axis for K; 0 means the whole axis.
        v_group: the same for V.
        scale_dtype: dtype of the stored scales and mins, ``"float16"`` or ``"float32"``.
        rope_dims: MLA only: trailing latent dims stored raw (not quantized).
    """

    bits: int
    k_axis: str = "channel"
    v_axis: str = "token"
    k_group: int = 0
    v_group: int = 0
    scale_dtype: str = "float16"
    rope_dims: int = 0

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8):
            raise HeaderError(f"quant.bits must be 2, 4 or 8, got {self.bits!r}")
        for name in ("k_axis", "v_axis"):
            if getattr(self, name) not in AXES:
                raise HeaderError(f"quant.{name} must be one of {AXES}, got {getattr(self, name)!r}")
        for name in ("k_group", "v_group", "rope_dims"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 1 << 20:
                raise HeaderError(f"quant.{name} must be an integer in [0, 2^20], got {v!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise HeaderError(f"quant.scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")

    def to_wire(self) -> dict[str, Any]:
        """The header's ``quant`` map, keys in a fixed order (SPEC.md §4.3)."""
        return {
            "bits": self.bits,
            "k_axis": self.k_axis,
            "v_axis": self.v_axis,
            "k_group": self.k_group,
            "v_group": self.v_group,
            "scale_dtype": self.scale_dtype,
            "rope_dims": self.rope_dims,
        }

    @classmethod
    def from_wire(cls, m: Any) -> "QuantParams":
        """Parse an untrusted ``quant`` map; unknown keys are ignored, wrong types raise HeaderError."""
        if not isinstance(m, Mapping):
            raise HeaderError("quant must be a map")
        if "bits" not in m:
            raise HeaderError("quant.bits is required")
        kwargs: dict[str, Any] = {}
        for key, typ in (("bits", int), ("k_axis", str), ("v_axis", str), ("k_group", int),
                         ("v_group", int), ("scale_dtype", str), ("rope_dims", int)):
            if key in m:
                val = m[key]
                if not isinstance(val, typ) or isinstance(val, bool):
                    raise HeaderError(f"quant.{key} must be {typ.__name__}")
                kwargs[key] = val
        return cls(**kwargs)
