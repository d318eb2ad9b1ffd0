"""What crosses vLLM's process boundary each step: loads and saves (scheduler -> workers) and
finished saves (workers -> scheduler). Plain dataclasses of ints, strings and bytes, so vLLM's
serializer carries them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier_vllm.compat import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(slots=True)
class LoadSpec:
    """Load ``hashes`` into vLLM blocks ``block_ids`` (pairwise) for request ``req_id``.

    Attributes:
        is_async: the request waits for this load in ``WAITING_FOR_REMOTE_KVS`` until a worker
            reports it in ``finished_recving``; otherwise it is loaded before this step's forward.
    """

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    is_async: bool


@dataclass(slots=True)
class SaveSpec:
    """Save vLLM blocks ``block_ids`` under ``hashes`` after this step's forward.

    Attributes:
        seq: the request's save number (0, 1, ...), by which workers report it done.
        token_ids: the tokens of the saved blocks (for the daemon's KV events).
        parent: chain hash of the block before the first saved one; None at the request's start.
    """

    req_id: str
    seq: int
    hashes: list[bytes]
    block_ids: list[int]
    token_ids: list[int]
    parent: bytes | None


@dataclass(slots=True)
class KVTierMetadata(KVConnectorMetadata):
    """One step's work for the workers.

    Attributes:
        loads: loads to start this step.
        saves: saves of blocks this step's forward completes.
        held: finished requests whose blocks the scheduler keeps until their saves end; a worker
            reports each in ``finished_sending`` once its own saves of it are done.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    held: list[str] = field(default_factory=list)


@dataclass(slots=True)
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Saves that ended on workers since their last report: per request, the save numbers,
    once per worker (so the scheduler counts a save complete when every worker reported it).

    Attributes:
        done: request id -> save numbers that ended (stored, partly stored or failed).
        stored: request id -> save numbers whose every block is stored now.
    """

    done: dict[str, list[int]] = field(default_factory=dict)
    stored: dict[str, list[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMeta:
        """Merge another worker's report (lists concatenate: each worker's copy counts once)."""
        assert isinstance(other, KVTierWorkerMeta), f"cannot merge {type(other).__name__}"
        for mine, theirs in ((self.done, other.done), (self.stored, other.stored)):
            for req_id, seqs in theirs.items():
                mine.setdefault(req_id, []).extend(seqs)
        return self
