"""llm-d's KV-event indexer, rebuilt from ``llm-d/llm-d-router`` (``pkg/kvevents/pool.go``,
``engineadapter/vllm_adapter.go``, ``pkg/kvcache/kvblock/token_processor.go``) for tests.

It does what llm-d does with a pod's events, not what kvtier would like it to do:

- frames: exactly 3, ``[topic, seq (8 bytes BE), payload]``; topic ``kv@<pod>@<model>``;
- payload: msgpack ``[ts, events, dp_rank]`` with each event a ``"type"``-tagged map or a legacy
  array; hashes are u64 ints (bytes: last 8, big-endian);
- its OWN keys ("request keys") from ``token_ids``: FNV-64a over canonical CBOR
  ``[parent, tokens, extra]``, chunks of ``block_size_tokens`` (16), seeded with
  ``fnv64a(hash_seed)`` then hashed once with the model name as the extra;
- engine hashes are only opaque keys mapped to request keys (1:1, many:1, 1:many by count); a
  ``BlockStored`` whose parent engine hash is unknown is dropped; an event with no tokens is a
  tier-location update of already indexed hashes; with ``group_idx`` set, the kind must be full
  or MLA attention and ``len(token_ids) == len(block_hashes) * block_size``;
- ``medium`` lowercased ("" is "gpu") is the entry's tier; removals are reference-counted per
  (pod, tier).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import cbor2
import msgpack

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
ACCEPTED_KINDS = ("full_attention", "mla_attention", "sink_full_attention")
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "kv_cache_spec_kind")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def fnv64a(data: bytes) -> int:
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def request_hash(parent: int, tokens: list[int] | None, extra: Any) -> int:
    """llm-d's ``hash``: FNV-64a of canonical CBOR ``[parent, tokens, extra]`` (nil tokens: null)."""
    return fnv64a(cbor2.dumps([parent, tokens, extra], canonical=True))


def engine_u64(h: Any) -> int:
    """An event hash as llm-d reads it: an int as u64, bytes by their last 8 bytes big-endian."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:].rjust(8, b"\0"), "big")
    return h & 0xFFFFFFFFFFFFFFFF


@dataclass
class LlmdIndexer:
    """One llm-d indexer fed with the frames of one pod's publisher.

    Attributes:
        block_size_tokens: llm-d's canonical block size (``tokenProcessorConfig.blockSizeTokens``).
        hash_seed: llm-d's ``hashSeed``.
        index: request key -> tier -> pods holding it there.
        history: request key -> ``"+tier"`` / ``"-tier"`` as applied, in order.
        dropped: BlockStored events dropped (unknown parent, or skipped by the rules above).
        last_seq: the sequence number of the last message, or None.
    """

    block_size_tokens: int = 16
    hash_seed: str = ""
    index: dict[int, dict[str, set[str]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(set)))
    history: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    engine_to_request: dict[int, list[int]] = field(default_factory=dict)
    refs: dict[tuple[str, str, int], int] = field(default_factory=lambda: defaultdict(int))
    dropped: int = 0
    last_seq: int | None = None

    def keys(self, tokens: list[int], model: str, parent: int | None = None) -> list[int]:
        """llm-d's ``TokensToKVBlockKeys``: request keys of the full chunks of ``tokens``."""
        prefix = parent if parent is not None else request_hash(fnv64a(self.hash_seed.encode()), None, model)
        out = []
        for i in range(0, len(tokens) - self.block_size_tokens + 1, self.block_size_tokens):
            prefix = request_hash(prefix, list(tokens[i:i + self.block_size_tokens]), None)
            out.append(prefix)
        return out

    def lookup(self, tokens: list[int], model: str, pod: str) -> list[set[str]]:
        """Per request key of ``tokens``, the tiers where ``pod`` holds it, up to the first key it
        holds nowhere (the scorer's longest consecutive prefix)."""
        out = []
        for key in self.keys(tokens, model):
            tiers = {tier for tier, pods in self.index.get(key, {}).items() if pod in pods}
            if not tiers:
                break
            out.append(tiers)
        return out

    def feed(self, frames: list[bytes]) -> None:
        """Apply one live (or replayed) message."""
        assert len(frames) == 3 and len(frames[1]) >= 8, "llm-d reads exactly 3 frames"
        topic = frames[0].decode()
        parts = topic.split("@")
        assert len(parts) == 3 and parts[0] == "kv", f"topic {topic!r} is not kv@<pod>@<model>"
        pod, model = parts[1], parts[2]
        self.last_seq = int.from_bytes(frames[1][:8], "big")
        batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        for raw in batch[1]:
            ev = _as_map(raw)
            if ev["type"] == "BlockStored":
                self._stored(ev, pod, model)
            elif ev["type"] == "BlockRemoved":
                self._removed(ev, pod)
            elif ev["type"] == "AllBlocksCleared":
                for tiers in self.index.values():
                    for pods in tiers.values():
                        pods.discard(pod)

    def _stored(self, ev: dict[str, Any], pod: str, model: str) -> None:
        hashes = [engine_u64(h) for h in ev["block_hashes"]]
        tokens, tier = list(ev.get("token_ids") or []), (ev.get("medium") or "gpu").lower()
        if ev.get("group_idx") is not None and (ev.get("kv_cache_spec_kind") not in ACCEPTED_KINDS
                                                or len(tokens) != len(hashes) * ev["block_size"]):
            self.dropped += 1
            return
        model = ev.get("lora_name") or model
        if not tokens:  # a tier-location update: only hashes indexed before count
            for h in hashes:
                for key in self.engine_to_request.get(h, []):
                    self._add(key, tier, pod, h)
            return
        parent = None
        if ev.get("parent_block_hash") is not None and engine_u64(ev["parent_block_hash"]) != 0:
            known = self.engine_to_request.get(engine_u64(ev["parent_block_hash"]))
            if not known:
                self.dropped += 1  # llm-d drops an event whose parent it has not seen
                return
            parent = known[-1]
        keys = self.keys(tokens, model, parent)
        if not keys:
            return
        for h, mapped in zip(hashes, _map(len(hashes), keys)):
            self.engine_to_request[h] = mapped
            for key in mapped:
                self._add(key, tier, pod, h)

    def _removed(self, ev: dict[str, Any], pod: str) -> None:
        tier = (ev.get("medium") or "gpu").lower()
        for h in (engine_u64(x) for x in ev["block_hashes"]):
            ref = (pod, tier, h)
            if self.refs[ref] == 0:
                continue  # unknown to this (pod, tier): a no-op in llm-d's index
            self.refs[ref] -= 1
            if self.refs[ref] == 0:
                for key in self.engine_to_request.get(h, []):
                    self.index[key][tier].discard(pod)
                    self.history[key].append("-" + tier)

    def _add(self, key: int, tier: str, pod: str, engine_hash: int) -> None:
        self.index[key][tier].add(pod)
        self.history[key].append("+" + tier)
        self.refs[(pod, tier, engine_hash)] += 1


def _map(n_engine: int, keys: list[int]) -> list[list[int]]:
    """llm-d's ``Index.Add`` mapping of engine keys to request keys, inferred from their counts."""
    if n_engine == len(keys):
        return [[k] for k in keys]
    if n_engine < len(keys):  # 1:many: each engine block covers several canonical blocks
        per = len(keys) // n_engine
        return [keys[i * per:(i + 1) * per] for i in range(n_engine)]
    per = n_engine // len(keys)  # many:1
    return [[keys[min(i // per, len(keys) - 1)]] for i in range(n_engine)]


def _as_map(raw: Any) -> dict[str, Any]:
    """An event in the map encoding, or a legacy array ``[type, field...]`` read as one."""
    if isinstance(raw, dict):
        return raw
    kind, *values = raw
    names = STORED_FIELDS if kind == "BlockStored" else REMOVED_FIELDS if kind == "BlockRemoved" else ()
    return {"type": kind, **dict(zip(names, values))}
