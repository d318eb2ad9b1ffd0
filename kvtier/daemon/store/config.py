"""Settings of the tiered store. Torch-free, I/O-free.

Every value is checked in ``__post_init__`` and a bad one raises a typed error that is also a
``ValueError`` (never an ``assert``: ``python -O`` strips those).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvtier_protocol.codec_plan import CODECS, default_quant
from kvtier_protocol.errors import CapacityError, InvalidRequest
from kvtier_protocol.quant import AXES, QuantParams


class StoreConfigError(InvalidRequest, ValueError):
    """A store setting is invalid."""


class ZeroCapacity(CapacityError, ValueError):
    """A tier that is switched on was given no bytes."""


_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DEVICE = re.compile(r"[a-z_]{1,32}(:[0-9]{1,4})?")
TIER_COMPRESSIONS = ("none", "lz4")
"""Values of ``disk_compression``: the lossless stage after the codec (SPEC.md §4.8), or none."""
GPU_SEGMENT_BYTES = 1 << 30  # default device pool size (one tensor)
K_AXES = AXES
"""Values of ``disk_k_axis`` (and the remote tier's ``k_axis``): what one K scale covers (SPEC.md §5.2)."""
MAX_MODEL_PATTERNS = 256
"""Entries of one tier's ``models`` table at most (each block's namespace is matched in order)."""
MAX_PATTERN_BYTES = 256
"""A pattern's length at most: a namespace's ``model`` is 1..256 UTF-8 bytes (SPEC.md §2)."""

CodecModels = tuple[tuple[str, str], ...]
"""A tier's per-model codec table: ``(fnmatch pattern of a namespace's model, codec)`` pairs, in
order; the first pattern that matches decides (:func:`codec_for_model`)."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of a :class:`~kvtier.daemon.store.store.TieredStore`.

    Attributes:
        host_bytes: byte budget of the shared host-memory tier (required, > 0).
        host_segment_bytes: size of one shared-memory segment; a block never spans two, so this
            is also the largest block the store accepts. 0: one segment of ``host_bytes``.
        host_name_prefix: prefix of the shared-memory segment names.
        host_prefault: touch every page of the host tier in the background at start.
        host_pin: page-lock the host tier with CUDA in the background: None when CUDA is
            available (checking imports torch), False never, True when CUDA is available.
        disk_path: directory of the disk tier (one O_DIRECT file per block record, their
            metadata in RocksDB); None switches the disk tier off.
        disk_bytes: byte budget of the disk tier (records: header + payload); > 0 with a path.
        disk_sync_writes: on each write, fdatasync the block files, fsync their directories and
            sync RocksDB's log (survives power loss, not just a crash of the process; slower).
        gpu_bytes: byte budget of the GPU tier (device memory reserved at start); 0 switches the
            tier off. Blocks enter it only through ``reserve(..., tier=Tier.GPU)``; its evictions
            go down into host memory.
        gpu_device: torch device of the GPU tier: ``"cuda"``, ``"cuda:N"``, or ``"cpu"`` (the same
            logic in host memory; what tests use). A CUDA device that is not available is refused
            when the store is made (StoreConfigError); this module does not import torch.
        gpu_segment_bytes: size of one device pool tensor, the largest block the GPU tier takes.
            0: pools of 1 GiB (one smaller pool when ``gpu_bytes`` is smaller).
        write_through: write each block to disk at commit, and acknowledge the commit only once
            the disk write returned. Off: blocks reach disk when evicted from host (write-back).
        disk_admit_hits: accesses (the commit counts as one, each acquire as one more) a block
            needs before a host eviction may write it to disk; 0 or 1 admit every block.
            Write-through ignores the filter (durability was asked for).
        admission_ghosts: dropped blocks whose access counts are remembered by the filter.
        lease_seconds: lease length when a call names none.
        max_lease_seconds: upper bound on any lease a client asks for.
        verify_on_commit: check each payload against its header checksum at commit. Off by
            default: the client computed that checksum over the very bytes it wrote into the slot,
            so a pass over the payload here would cost ~1/7 s per GB on the hot put path to catch
            only a buggy client; every move (demotion, write-through, promotion) and every disk
            read verifies anyway, so a bad payload is never written down nor served from disk.
        scrub_commits: check each committed host payload against its header checksum once, in
            the background soon after commit (:mod:`kvtier.daemon.store.scrub`); acquire then reports
            the block ``checked`` and same-host readers copy it without hashing it again. A bad
            payload is deleted and counted. Off: every reader verifies every load itself.
        priority_classes: eviction classes; blocks of class 0 go first, the highest class last.
        hash_bytes: length of a chain hash (32 for the sha256 schemes).
        io_threads: threads of the executor that runs disk I/O and large copies.
        max_events: events kept for ``take_events``; older ones are dropped (0: no events).
        max_batch: keys per call; larger batches are refused (bounds the work of one request).
        flush_on_close: at ``close()``, write every committed memory block (host or GPU) that has
            no disk copy down to disk, verified, before closing the disk tier (then sync it), so a
            restart after a clean shutdown keeps what the disk tier may keep: blocks the
            admission filter rejects are not written, and the disk's capacity and eviction apply
            as for demotions. No effect without a disk tier.
        disk_codec: the codec of records demoted from host to disk (issue 25; TOML
            ``[tiers.disk] codec``). ``"raw"`` (default) writes every record as it is: every hit
            stays exact. A quantizing codec (``"int8"``, ...) re-encodes, on the I/O pool, each
            demoted record whose header says raw float16/bfloat16/float32 KV; the disk record
            (and any host copy promoted from it later) then says that codec in its header, and
            a request with ``accept_lossy`` false treats it as a miss. Other records (another
            codec, compressed, another dtype, data the codec refuses) go down as they are, and
            so do write-through and flush-at-close copies (their host copy stays, and a block
            has one header).
        disk_k_axis: what one K scale covers when ``disk_codec`` (or a ``disk_models`` codec)
            is ``int8``, ``int4`` or ``int2`` and the block is MHA (TOML ``[tiers.disk] k_axis``):
            ``"channel"`` (default; SPEC.md §5.2's default: one scale and min per channel over the
            block's tokens) or ``"token"`` (one per token over the row, like V; whole-row groups
            for int8, the codec's default group for int4/int2). At 16-token blocks per-channel
            scales cost 2 bits per element (int8: 9.125 bits, 1.75x raw bf16), per-token ones
            0.25 (8.25 bits, 1.94x; SPEC.md §5.9). fp8 ignores axes (§5.7) and MLA's latent is
            always per token (§5.8): there this setting does nothing.
        disk_models: per-model exceptions to ``disk_codec`` (TOML ``[tiers.disk.models]``):
            ``(pattern, codec)`` pairs (a mapping is taken too, in its order); a block whose
            namespace's ``model`` matches a pattern (:func:`fnmatch.fnmatchcase`: ``*``, ``?``,
            ``[...]``; case-sensitive) takes that pattern's codec on disk instead, the first
            matching pattern deciding (put specific patterns before broad ones). ``"raw"`` keeps a
            model exact on disk under a lossy ``disk_codec``; a lossy codec re-encodes a model
            whose tier default is raw. A block's model is its registered namespace's (else its
            header's ``ns_fields``); a block of a namespace the daemon does not know takes
            ``disk_codec``.
        disk_compression: ``"lz4"``: byte-shuffle and LZ4 each section of a re-encoded disk
            record (SPEC.md §4.8; lossless); ``"none"`` (default). Applies only to records that
            ``disk_codec`` re-encodes.
        accept_lossy: the default of requests that do not say (``accept_lossy`` of lookup,
            acquire and get): True serves any stored copy; False only exact ones (codec raw),
            a lossy copy being a miss that ends the prefix.
    """

    host_bytes: int
    host_segment_bytes: int = 0
    host_name_prefix: str = "kvtier"
    host_prefault: bool = True
    host_pin: bool | None = None
    disk_path: str | None = None
    disk_bytes: int = 0
    disk_sync_writes: bool = False
    gpu_bytes: int = 0
    gpu_device: str = "cuda"
    gpu_segment_bytes: int = 0
    write_through: bool = False
    disk_admit_hits: int = 0
    admission_ghosts: int = 65536
    lease_seconds: float = 30.0
    max_lease_seconds: float = 600.0
    verify_on_commit: bool = False
    scrub_commits: bool = True
    priority_classes: int = 4
    hash_bytes: int = 32
    io_threads: int = 2
    max_events: int = 65536
    max_batch: int = 65536
    flush_on_close: bool = True
    disk_codec: str = "raw"
    disk_compression: str = "none"
    accept_lossy: bool = True
    disk_k_axis: str = "channel"
    disk_models: CodecModels = ()

    def __post_init__(self) -> None:
        _int(self, "host_bytes", 0)
        if self.host_bytes == 0:
            raise ZeroCapacity("host_bytes must be > 0: the host tier is where blocks are written")
        _int(self, "host_segment_bytes", 0)
        if not isinstance(self.host_name_prefix, str) or not _PREFIX.fullmatch(self.host_name_prefix):
            raise StoreConfigError(f"host_name_prefix must be 1-64 of [A-Za-z0-9_-], got {self.host_name_prefix!r}")
        _int(self, "disk_bytes", 0)
        if self.disk_path is not None:
            if not isinstance(self.disk_path, str) or not self.disk_path:
                raise StoreConfigError(f"disk_path must be a non-empty path or None, got {self.disk_path!r}")
            if self.disk_bytes == 0:
                raise ZeroCapacity("disk_bytes must be > 0 when disk_path is set")
        elif self.write_through:
            raise StoreConfigError("write_through needs a disk tier (disk_path)")
        _int(self, "gpu_bytes", 0)
        _int(self, "gpu_segment_bytes", 0)
        if not isinstance(self.gpu_device, str) or not _DEVICE.fullmatch(self.gpu_device):
            raise StoreConfigError(f"gpu_device must name a torch device such as 'cuda', 'cuda:1' or 'cpu', "
                                   f"got {self.gpu_device!r}")
        _int(self, "disk_admit_hits", 0, 1 << 20)
        _int(self, "admission_ghosts", 0)
        _int(self, "priority_classes", 1, 64)
        _int(self, "hash_bytes", 8, 64)
        _int(self, "io_threads", 1, 256)
        _int(self, "max_events", 0)
        _int(self, "max_batch", 1)
        if not isinstance(self.flush_on_close, bool):
            raise StoreConfigError(f"flush_on_close must be a bool, got {self.flush_on_close!r}")
        if self.disk_codec not in CODECS:
            raise StoreConfigError(f"disk_codec must be one of {CODECS}, got {self.disk_codec!r}")
        if self.disk_k_axis not in K_AXES:
            raise StoreConfigError(f"disk_k_axis must be one of {K_AXES}, got {self.disk_k_axis!r:.80}")
        object.__setattr__(self, "disk_models", check_codec_models("disk_models", self.disk_models))
        if self.disk_compression not in TIER_COMPRESSIONS:
            raise StoreConfigError(f"disk_compression must be one of {TIER_COMPRESSIONS}, got {self.disk_compression!r}")
        if not isinstance(self.accept_lossy, bool):
            raise StoreConfigError(f"accept_lossy must be a bool, got {self.accept_lossy!r}")
        for name in ("lease_seconds", "max_lease_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise StoreConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.lease_seconds > self.max_lease_seconds:
            raise StoreConfigError(f"lease_seconds {self.lease_seconds} > max_lease_seconds {self.max_lease_seconds}")

    @property
    def disk_recodes(self) -> bool:
        """Whether any block may be re-encoded on its way to disk (a lossy ``disk_codec`` or
        ``disk_models`` codec)."""
        return any_lossy(self.disk_codec, self.disk_models)

    @property
    def segment_bytes(self) -> int:
        """The effective segment size (the largest block the host tier can hold)."""
        return self.host_segment_bytes or self.host_bytes

    @property
    def gpu_segment(self) -> int:
        """The effective device pool size (the largest block the GPU tier can hold)."""
        return min(self.gpu_segment_bytes or GPU_SEGMENT_BYTES, self.gpu_bytes)


def _int(cfg: StoreConfig, name: str, lo: int, hi: int = 1 << 62) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise StoreConfigError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")


def check_codec_models(name: str, value: Any) -> CodecModels:
    """A tier's ``models`` table as ``(pattern, codec)`` pairs, in order, checked.

    Args:
        name: the option, for the error (``"disk_models"``, ``"remote.models"``).
        value: a mapping of pattern to codec (a TOML table keeps the file's order) or a sequence
            of ``(pattern, codec)`` pairs.

    Raises:
        StoreConfigError: not a table of text to codec names, an empty pattern, one longer than
            a model name can be or holding a NUL, a pattern twice, an unknown codec, too many
            entries. The message names ``name`` and the pattern.
    """
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise StoreConfigError(f"{name} must be a table of model pattern = codec, got {value!r:.80}")
    if len(pairs) > MAX_MODEL_PATTERNS:
        raise StoreConfigError(f"{name} has {len(pairs)} patterns; at most {MAX_MODEL_PATTERNS}")
    seen: set[str] = set()
    for pattern, codec in pairs:
        if not isinstance(pattern, str) or not pattern or "\x00" in pattern or \
                len(pattern.encode("utf-8", "surrogatepass")) > MAX_PATTERN_BYTES:
            raise StoreConfigError(f"{name}: pattern {pattern!r:.80} must be 1..{MAX_PATTERN_BYTES} bytes of text "
                                   "(an fnmatch pattern of a namespace's model)")
        if pattern in seen:
            raise StoreConfigError(f"{name}: pattern {pattern!r:.80} appears twice")
        seen.add(pattern)
        if not isinstance(codec, str) or codec not in CODECS:
            raise StoreConfigError(f"{name}[{pattern!r:.80}] must be one of {CODECS}, got {codec!r:.80}")
    return tuple((p, c) for p, c in pairs)


def codec_for_model(models: CodecModels, default: str, model: str | None) -> str:
    """The codec of a tier for a block of ``model`` (None: unknown): the codec of the first
    pattern of ``models`` that matches it (case-sensitive fnmatch), else ``default``."""
    if model is not None:
        for pattern, codec in models:
            if fnmatch.fnmatchcase(model, pattern):
                return codec
    return default


def any_lossy(default: str, models: CodecModels) -> bool:
    """Whether a tier with codec ``default`` and table ``models`` may re-encode any block."""
    return default != "raw" or any(codec != "raw" for _, codec in models)


def tier_quant(codec: str, k_axis: str, *, mla: bool) -> QuantParams | None:
    """The codec parameters a tier re-encodes with: None for the codec's defaults (what
    :func:`kvtier_protocol.block.encode_block` then picks: raw, fp8 (axes ignored, SPEC.md §5.7),
    MLA (per token, with the namespace's rope dims, §5.8) and K per channel); else the MHA
    defaults of ``codec`` (int8/int4/int2) with K per token: the scale dtype and group sizes stay
    the defaults (K's group is V's: 0, the whole row, for int8; 32 for int4/int2)."""
    assert k_axis in K_AXES, "checked by the config"
    if k_axis == "channel" or mla or codec in ("raw", "fp8_e4m3"):
        return None
    q = default_quant(codec)
    assert q is not None, "a quantizing codec has defaults"
    return replace(q, k_axis="token", k_group=q.v_group)
