"""Hypothesis strategies shared by the fuzz tests: any msgpack value, bounded in size and depth."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Moderate example counts: the full runs are `kvtier bench fuzz` (100,000 inputs per decoder)."""

ints = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1),
                 st.sampled_from([0, 1, -1, 255, 256, 65535, 1 << 31, 1 << 32, 1 << 63, (1 << 64) - 1]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=40),
                    st.binary(max_size=80))
msgpack_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                     st.dictionaries(st.text(max_size=12), inner, max_size=6)),
    max_leaves=30)
"""Any value msgpack can pack with string map keys (what our decoders see after unpacking)."""
