"""The host tier: named shared-memory segments that the daemon and its clients map, carved into slots.

The daemon creates the segments; a connector maps them (by name, or by an fd passed over the unix
socket) and copies blocks straight into and out of reserved slots, so only metadata crosses the
socket. Start-up never waits for the memory: pre-faulting (and, where CUDA exists, pinning with
``cudaHostRegister``, which takes minutes on large buffers: vllm#42632) runs in a background
thread; ``prefault_done`` and ``pin_done`` tell when each has finished.

torch is imported only when pinning or when :meth:`HostTier.torch_view` is used.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier_protocol.errors import InvalidRequest, KVTierError, StorageError

from kvtier.daemon.store import shm
from kvtier.daemon.store.allocator import SlabAllocator
from kvtier.daemon.store.pooled import SlabBackedTier
from kvtier.daemon.store.types import Slot

if TYPE_CHECKING:
    import ctypes

    import torch

log = logging.getLogger(__name__)

GIB = 1 << 30
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not just the current one


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One shared-memory segment, as a client needs it to map the segment."""

    index: int  # Slot.segment refers to this
    name: str  # file name under /dev/shm
    size: int  # bytes
    fd: int  # the daemon's descriptor, to send over SCM_RIGHTS; owned by the tier


@dataclass(slots=True)
class _Resources:
    """Everything the tier must release, kept apart from the tier so a weakref finalizer can free
    it (a crashed test or a dropped tier leaks no /dev/shm file)."""

    names: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    maps: list[mmap.mmap] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)
    anchors: list[ctypes.Array] = field(default_factory=list)  # hold the addresses valid
    pinned: list[int] = field(default_factory=list)  # addresses registered with CUDA
    stop: threading.Event = field(default_factory=threading.Event)
    worker: threading.Thread | None = None

    def release(self) -> None:
        self.stop.set()
        if self.worker is not None and self.worker is not threading.current_thread():
            self.worker.join()
        if self.pinned:
            _unpin(self.pinned)
        self.anchors.clear()
        for mm in self.maps:
            try:
                mm.close()
            except BufferError:
                # A view is still alive somewhere; the mapping goes when it does. The file is
                # unlinked below, so the memory is returned then.
                log.debug("host tier closed while a view of a segment is alive")
        self.maps.clear()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        for name in self.names:
            shm.unlink_segment(name)
        self.names.clear()


class HostTier(SlabBackedTier):
    """Shared host memory for blocks: segments in /dev/shm, slots handed out by a slab allocator.

    Args:
        capacity_bytes: bytes of the tier (rounded down to whole pages).
        segment_bytes: size of one segment (clamped to the capacity); the largest block.
        name_prefix: prefix of segment names; each name is ``prefix-pid-random``. Segments of this
            prefix left by a process that is gone (killed before it could unlink them) are
            removed first (:func:`kvtier.daemon.store.shm.reclaim_stale`).
        gone_pids: pids known to be dead (the previous owner of the store's directory, whose
            owner lock was free), whose segments go even if the pid still shows (a zombie).
        prefault: fault every page in the background so first writes are not slowed by page faults.
        pin: register the segments with CUDA (page-locked, for fast DMA) in the background.
            None: when CUDA is available. False: never. True: when CUDA is available (never an error).
        slab_bytes: largest slab of the allocator.

    Raises:
        CapacityError: the capacity is smaller than one page.
        StorageError: /dev/shm refused a segment.
    """

    def __init__(self, capacity_bytes: int, *, segment_bytes: int = GIB, name_prefix: str = "kvtier",
                 prefault: bool = True, pin: bool | None = None, slab_bytes: int = 64 << 20,
                 gone_pids: frozenset[int] = frozenset()) -> None:
        self._alloc = SlabAllocator(capacity_bytes, segment_bytes=min(segment_bytes, capacity_bytes),
                                    alignment=max(4096, mmap.PAGESIZE), slab_bytes=slab_bytes)
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release)
        self._closed = False
        self.prefault_done = threading.Event()
        self.pin_done = threading.Event()
        self.prefault_error: KVTierError | None = None
        for name, nbytes in shm.reclaim_stale(name_prefix, gone_pids):  # first: a full /dev/shm would refuse ours
            log.warning("removed shared-memory segment %s (%d MiB) left by a process that is gone",
                        name, nbytes >> 20)
        try:
            for size in self._alloc.segment_sizes:
                name = shm.unique_name(name_prefix)
                fd = shm.create_segment(name, size)
                self._res.names.append(name)
                self._res.fds.append(fd)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                self._res.maps.append(mm)
                address, anchor = shm.address_of(mm)
                self._res.addresses.append(address)
                self._res.anchors.append(anchor)
        except BaseException:
            self.close()
            raise
        self._views = [memoryview(mm) for mm in self._res.maps]
        self._sizes = self._alloc.segment_sizes
        if prefault or pin is not False:
            self._res.worker = threading.Thread(target=self._prepare, args=(prefault, pin), daemon=True,
                                                name="kvtier-host-prepare")
            self._res.worker.start()
        else:
            self.prefault_done.set()
            self.pin_done.set()

    # --- slots ---------------------------------------------------------------------------------

    def view(self, slot: Slot) -> memoryview:
        """A writable, zero-copy view of exactly the slot's bytes.

        Raises:
            InvalidRequest: the slot is outside the tier's segments.
            StorageError: the tier is closed.
        """
        if self._closed:
            raise StorageError("the host tier is closed")
        seg, off, end = slot.segment, slot.offset, slot.offset + slot.length
        if not (0 <= seg < len(self._sizes) and 0 <= off <= end <= self._sizes[seg]):
            raise InvalidRequest(f"{slot} is outside the host tier")
        return self._views[seg][off:end]

    def torch_view(self, slot: Slot) -> torch.Tensor:
        """A uint8 CPU tensor over the slot's bytes (shares memory; pinned when the tier is)."""
        import torch

        return torch.frombuffer(self.view(slot), dtype=torch.uint8)

    # --- inspection ----------------------------------------------------------------------------

    @property
    def segments(self) -> list[SegmentInfo]:
        """The segments, for clients to map (by name, or by fd over SCM_RIGHTS)."""
        return [SegmentInfo(i, n, s, fd) for i, (n, s, fd) in enumerate(zip(self._res.names, self._sizes, self._res.fds))]

    @property
    def segment_bytes(self) -> int:
        """The largest segment: no block larger than this can ever be stored."""
        return max(self._sizes)

    @property
    def pinned(self) -> bool:
        """Whether every segment is registered with CUDA."""
        return self.pin_done.is_set() and len(self._res.pinned) == len(self._sizes)

    # --- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop background work, unpin, unmap, close and unlink every segment. Idempotent.

        A view still held elsewhere keeps its mapping alive until it is dropped; the segment's
        file is gone already, so clients can no longer map it by name.
        """
        if self._closed:
            return
        self._closed = True
        for view in getattr(self, "_views", ()):
            view.release()
        self._views = []
        self._finalizer()

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self, prefault: bool, pin: bool | None) -> None:
        # Runs in the background thread. It may touch only self._res and the events: the tier
        # object may be closed meanwhile, in which case res.stop is set.
        res = self._res
        try:
            if prefault:
                for fd, address, size in zip(res.fds, res.addresses, self._sizes):
                    shm.populate(fd, address, size, res.stop)
        except KVTierError as e:
            self.prefault_error = e
            log.warning("host tier pre-fault failed: %s", e)
        finally:
            self.prefault_done.set()
        try:
            if pin is not False and not res.stop.is_set():
                _pin(res, self._sizes)
        finally:
            self.pin_done.set()


def _pin(res: _Resources, sizes: tuple[int, ...]) -> None:
    """Register each segment with CUDA when CUDA is available; failures are logged, not raised."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    cudart = torch.cuda.cudart()
    for address, size in zip(res.addresses, sizes):
        if res.stop.is_set():
            return
        err = int(cudart.cudaHostRegister(address, size, _CUDA_HOST_REGISTER_PORTABLE))
        if err != 0:
            log.warning("cudaHostRegister of %d bytes failed (cudaError %d); the host tier stays unpinned", size, err)
            return
        res.pinned.append(address)


def _unpin(addresses: list[int]) -> None:
    import torch

    cudart = torch.cuda.cudart()
    for address in addresses:
        err = int(cudart.cudaHostUnregister(address))
        if err != 0:
            log.warning("cudaHostUnregister failed (cudaError %d)", err)
    addresses.clear()
