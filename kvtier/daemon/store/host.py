"""The host tier: named shared-memory segments that the daemon and its clients map, carved into slots.

The daemon creates the segments; a connector maps them (by name, or by an fd passed over the unix
socket) and copies blocks straight into and out of reserved slots, so only metadata crosses the
socket. Start-up never waits for the memory: pre-faulting (and, where CUDA exists, pinning with
``cudaHostRegister``, which takes minutes on large buffers: vllm#42632) runs in a background
thread; ``prefault_done`` and ``pin_done`` tell when each has finished.

Crash recovery: given ``state_dir`` (a directory whose owner lock the caller holds), the tier
records its segments in a segment directory file there and journals its committed slots in
/dev/shm (:mod:`kvtier.daemon.store.host_journal`). A tier made after a crash (kill -9, the OOM
killer) finds the segments the dead daemon left through that file and **adopts** them: it maps
them again (renamed to this process's names), and hands the journal's live entries to the store
(:attr:`HostTier.recovered`), which verifies each one against the segment before it indexes it
and claims its slot (:meth:`HostTier.adopt_slots`; :mod:`kvtier.daemon.store.host_recovery`).
Segments whose layout no longer matches the configuration (another size, segment size or
prefix) are removed instead. A clean close removes segments, journal and directory file.

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
from kvtier.daemon.store.host_journal import JOURNAL_SUFFIX, SegmentDirectory, SlotJournal, read_journal, replay
from kvtier.daemon.store.pooled import SlabBackedTier
from kvtier.daemon.store.types import Slot

if TYPE_CHECKING:
    import ctypes
    from collections.abc import Sequence

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
    journal: SlotJournal | None = None
    state_dir: str | None = None  # where the segment directory file is

    def release(self) -> None:
        self.stop.set()
        if self.journal is not None:
            self.journal.close(remove=True)
            self.journal = None
        if self.state_dir is not None:
            SegmentDirectory.remove(self.state_dir)
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
        state_dir: a directory whose owner lock the caller holds: keep the segment directory
            there and journal committed slots, and adopt the segments a crashed owner left (see
            the module docstring). None: no crash recovery (the segments die with the tier).

    Attributes:
        recovered: after an adoption, the journal's live entries, ``(segment, offset) ->
            (slot, priority, header)``, not verified yet: the store checks each one and claims
            the good ones (:meth:`adopt_slots`), then clears this.
        adopted_from: the pid of the daemon whose segments were adopted (None: fresh segments).
        journal_torn: 1 when the adopted journal ended in a torn entry (dropped).

    Raises:
        CapacityError: the capacity is smaller than one page.
        StorageError: /dev/shm refused a segment.
    """

    def __init__(self, capacity_bytes: int, *, segment_bytes: int = GIB, name_prefix: str = "kvtier",
                 prefault: bool = True, pin: bool | None = None, slab_bytes: int = 64 << 20,
                 gone_pids: frozenset[int] = frozenset(), state_dir: str | None = None) -> None:
        self._alloc = SlabAllocator(capacity_bytes, segment_bytes=min(segment_bytes, capacity_bytes),
                                    alignment=max(4096, mmap.PAGESIZE), slab_bytes=slab_bytes)
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release)
        self._closed = False
        self._journal_failed = False
        self.prefault_done = threading.Event()
        self.pin_done = threading.Event()
        self.prefault_error: KVTierError | None = None
        self.recovered: dict[tuple[int, int], tuple[Slot, int, bytes]] = {}
        self.adopted_from: int | None = None
        self.journal_torn = 0
        self._old_journals: list[str] = []  # an adopted journal's names, removed once ours is written
        try:
            found = self._adopt(state_dir, name_prefix) if state_dir is not None else None
            keep = frozenset(n for n, _ in found) if found else frozenset()
            # Before ours are made: a full /dev/shm would refuse them.
            for name, nbytes in shm.reclaim_stale(name_prefix, gone_pids, keep):
                log.warning("removed shared-memory segment %s (%d MiB) left by a process that is gone",
                            name, nbytes >> 20)
            for i, size in enumerate(self._alloc.segment_sizes):
                if found:
                    name, fd = found[i]
                else:
                    name = shm.unique_name(name_prefix)
                    fd = shm.create_segment(name, size)
                self._res.names.append(name)
                self._res.fds.append(fd)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                self._res.maps.append(mm)
                address, anchor = shm.address_of(mm)
                self._res.addresses.append(address)
                self._res.anchors.append(anchor)
            if state_dir is not None:
                self._journal_to(state_dir, name_prefix)
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

    # --- crash recovery (see the module docstring) --------------------------------------------

    def _adopt(self, state_dir: str, prefix: str) -> list[tuple[str, int]] | None:
        """Open the segments a dead owner of ``state_dir`` left: ``[(name, fd)]`` per segment, in
        order, with the journal's live entries in :attr:`recovered`; None when there is nothing
        to adopt (what was found that cannot be adopted is removed)."""
        d = SegmentDirectory.read(state_dir)
        if d is None:
            return None
        fds: list[tuple[str, int]] = []
        why = ""
        if (d.prefix, d.sizes, d.alignment) != (prefix, self._alloc.segment_sizes, self._alloc.alignment):
            why = "its layout differs from this configuration"
        else:
            for name, was, size in zip(d.names, d.was or ("",) * len(d.names), d.sizes):
                for candidate in (name, was):
                    if not candidate:
                        continue
                    try:
                        fd, have = shm.open_segment(candidate)
                    except OSError:
                        continue
                    if have != size:
                        os.close(fd)
                        continue
                    fds.append((candidate, fd))
                    break
                else:
                    why = f"segment {name} is gone (a reboot empties /dev/shm)"
                    break
        journal = read_journal(d.journal)
        if journal is None and d.was and d.was[0]:
            journal = read_journal(d.was[0] + JOURNAL_SUFFIX)
        if not why and journal is None:
            why = "its slot journal is gone"
        if why:
            for _, fd in fds:
                os.close(fd)
            for name in (*d.names, *(w for w in d.was if w), d.journal):
                shm.unlink_segment(name)
            SegmentDirectory.remove(state_dir)
            log.warning("host tier: not adopting the segments pid %d left: %s", d.pid, why)
            return None
        assert journal is not None
        found = replay(journal)
        self.recovered = found.live
        self.journal_torn = found.torn
        self.adopted_from = d.pid
        # Take this process's names (so that another daemon's reclaim_stale, which judges a
        # segment by the pid in its name, never takes them): the directory first names both.
        new = [shm.unique_name(prefix) for _ in fds]
        SegmentDirectory(prefix, os.getpid(), self._alloc.alignment, tuple(new), self._alloc.segment_sizes,
                         new[0] + JOURNAL_SUFFIX, tuple(n for n, _ in fds)).write(state_dir)
        out = []
        for (old, fd), name in zip(fds, new):
            try:
                shm.rename_segment(old, name)
            except OSError:
                name = old  # keep its name; the directory's "was" still finds it
            out.append((name, fd))
        self._old_journals = [d.journal, *((d.was[0] + JOURNAL_SUFFIX,) if d.was and d.was[0] else ())]
        log.warning("host tier: adopting %d shared-memory segment(s) of pid %d (a crashed daemon): "
                    "%d journaled block(s) to verify%s", len(out), d.pid, len(found.live),
                    ", one torn journal entry dropped" if found.torn else "")
        return out

    def _journal_to(self, state_dir: str, prefix: str) -> None:
        """Write the segment directory and open the journal (seeded with the adopted entries)."""
        names = tuple(self._res.names)
        journal = names[0] + JOURNAL_SUFFIX
        self._res.state_dir = state_dir
        self._res.journal = SlotJournal(journal, self.recovered)
        SegmentDirectory(prefix, os.getpid(), self._alloc.alignment, names, self._alloc.segment_sizes,
                         journal).write(state_dir)
        for old in self._old_journals:
            if old != journal:
                shm.unlink_segment(old)

    @property
    def journal(self) -> SlotJournal | None:
        """The slot journal (None without ``state_dir``)."""
        return self._res.journal

    def adopt_slots(self, slots: list[Slot]) -> list[bool]:
        """Claim the verified slots of adopted blocks in the (still empty) allocator; per slot,
        whether it was claimed (False: it overlaps another or lies outside the segments)."""
        return self._alloc.adopt(slots)

    def journal_commit(self, slot: Slot, priority: int, header: bytes) -> None:
        """Journal a host copy that became visible (written by the next :meth:`journal_flush`)."""
        journal = self._res.journal
        if journal is not None:
            journal.commit(slot, priority, header)

    def journal_forget(self, slot: Slot) -> None:
        """Journal that the block in ``slot`` is gone (deleted while a reader still holds it)."""
        journal = self._res.journal
        if journal is not None:
            journal.free(slot)

    def journal_flush(self) -> None:
        """Write the journal's pending entries: before a commit is acknowledged, a delete returns."""
        journal = self._res.journal
        if journal is None:
            return
        try:
            journal.flush()
        except OSError as e:
            # Never a failed commit: the block is stored; only a crash would lose it from host.
            if not self._journal_failed:
                log.warning("host tier: the slot journal cannot be written (%s): a daemon crash "
                            "would lose host blocks committed from now on", e)
            self._journal_failed = True

    def free(self, slot: Slot) -> None:
        """Return a slot (and journal it gone). Raises InvalidRequest for a slot not allocated."""
        self._alloc.free(slot)
        journal = self._res.journal
        if journal is not None:
            journal.free(slot)

    def free_many(self, slots: Sequence[Slot]) -> None:
        """:meth:`free` each of ``slots``, in order: one pass over the allocator, one over the journal."""
        self._alloc.free_many(slots)
        journal = self._res.journal
        if journal is not None:
            journal.free_many(slots)

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
