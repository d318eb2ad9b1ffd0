"""Settings of the tiered store. Torch-free, I/O-free.

Every value is checked in ``__post_init__`` and a bad one raises a typed error that is also a
``ValueError`` (never an ``assert``: ``python -O`` strips those).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvtier_protocol.codec_plan import CODECS
from kvtier_protocol.errors import CapacityError, InvalidRequest


class StoreConfigError(InvalidRequest, ValueError):
    """A store setting is invalid."""


class ZeroCapacity(CapacityError, ValueError):
    """A tier that is switched on was given no bytes."""


_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DEVICE = re.compile(r"[a-z_]{1,32}(:[0-9]{1,4})?")
TIER_COMPRESSIONS = ("none", "lz4")
"""Values of ``disk_compression``: the lossless stage after the codec (SPEC.md §4.8), or none."""
GPU_SEGMENT_BYTES = 1 << 30  # default device pool size (one tensor)


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
