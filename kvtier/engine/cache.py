"""The paged KV cache: :class:`KVCache` (the tensors) and :class:`PageAllocator` (the bookkeeping).

A page holds the KV of ``block_tokens`` consecutive tokens of one sequence in every layer, so
one page is exactly one kvtier block. A sequence's block table lists its pages in token order::

    tokens   | 0 .. 15 | 16 .. 31 | 32 .. 40 (partial) |
    pages    |   7     |    2     |    9               |   slot of token t = table[t // T] * T + t % T

Full prompt blocks are named by their chain hash. A computed page keeps its hash (also after its
last user frees it, until the page is handed out again), so a later sequence with the same prefix
shares the page instead of recomputing it: eight requests with one system prompt hold one copy.
A shared page is never written: sharing stops one block short of the prompt's end (the engine
always computes the last prompt token), and new tokens go to positions past the shared ones.

:class:`PageAllocator` imports no torch, so the scheduler and its tests run without it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier_protocol.errors import CapacityError

if TYPE_CHECKING:
    import torch

    from kvtier.engine.model import Model


class PageAllocator:
    """Free list, reference counts and hash-named pages for one paged KV cache.

    Free pages are handed out oldest-freed first, so a freed page that still names a prefix
    survives as long as possible before it is reused for something else.

    Args:
        num_pages: pages in the cache (every id in ``range(num_pages)`` is usable; 0 is not special).
        block_tokens: tokens per page.
    """

    def __init__(self, num_pages: int, block_tokens: int) -> None:
        if num_pages < 1 or block_tokens < 1:
            raise ValueError(f"need num_pages >= 1 and block_tokens >= 1, got {num_pages}, {block_tokens}")
        self.num_pages = num_pages
        self.block_tokens = block_tokens
        self._ref_counts = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._hash_of: list[bytes | None] = [None] * num_pages  # the prefix a computed page holds
        self._page_of: dict[bytes, int] = {}  # chain hash -> computed page holding it

    @property
    def num_free(self) -> int:
        """Pages with no user (some may still name a prefix until they are reused)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages that name a prefix (used or free)."""
        return len(self._page_of)

    def ref_count(self, page: int) -> int:
        """Sequences using ``page``."""
        return self._ref_counts[page]

    def page_of(self, block_hash: bytes) -> int | None:
        """The computed page holding ``block_hash``, or None."""
        return self._page_of.get(block_hash)

    def num_cached_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` already computed in some page."""
        n = 0
        for h in block_hashes:
            if h not in self._page_of:
                break
            n += 1
        return n

    def num_pages_to_take(self, shared: Sequence[bytes], num_new: int) -> int:
        """Free pages that :meth:`allocate` (``shared``, ``num_new``) would take off the free list."""
        revived = sum(1 for h in shared if self._ref_counts[self._page_of[h]] == 0)
        return num_new + revived

    def can_allocate(self, shared: Sequence[bytes], num_new: int) -> bool:
        """Whether :meth:`allocate` (``shared``, ``num_new``) would succeed now."""
        return self.num_pages_to_take(shared, num_new) <= len(self._free)

    def allocate(self, shared: Sequence[bytes], num_new: int) -> list[int] | None:
        """A block table: the pages of the computed prefix ``shared``, then ``num_new`` fresh pages.

        Args:
            shared: chain hashes of leading blocks that are computed in some page (see
                :meth:`num_cached_blocks`); their pages gain a user.
            num_new: fresh pages for the rest; they name nothing until :meth:`cache` is called.

        Returns:
            The page ids in token order, or None (nothing changed) when too few pages are free.
        """
        if not self.can_allocate(shared, num_new):
            return None
        table = []
        for h in shared:
            page = self._page_of[h]
            if self._ref_counts[page] == 0:
                del self._free[page]
            self._ref_counts[page] += 1
            table.append(page)
        for _ in range(num_new):
            page, _ = self._free.popitem(last=False)
            self._forget(page)
            self._ref_counts[page] = 1
            table.append(page)
        return table

    def cache(self, block_hash: bytes, page: int) -> bool:
        """Name ``page`` (now computed) by ``block_hash`` so later prefixes can share it.

        Returns:
            False when another page already holds this hash (the first copy stays the shared one).
        """
        assert self._ref_counts[page] > 0, f"page {page} is not in use"
        if block_hash in self._page_of:
            return self._page_of[block_hash] == page
        assert self._hash_of[page] is None, f"page {page} already holds another block"
        self._page_of[block_hash] = page
        self._hash_of[page] = block_hash
        return True

    def free(self, table: Sequence[int]) -> None:
        """Drop one user of every page in ``table``; a page with no user goes to the free list.

        Pages are released last-first so that, of a freed table, the prefix pages stay longest.
        """
        for page in reversed(table):
            assert self._ref_counts[page] > 0, f"page {page} freed twice"
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free[page] = None

    def reset_prefix_cache(self) -> int:
        """Forget the prefixes of every free page (used pages keep theirs). Returns pages forgotten."""
        forgotten = 0
        for page in self._free:
            if self._hash_of[page] is not None:
                self._forget(page)
                forgotten += 1
        return forgotten

    def _forget(self, page: int) -> None:
        h = self._hash_of[page]
        if h is not None:
            del self._page_of[h]
            self._hash_of[page] = None


class KVCache:
    """The per-layer paged KV tensors of one model.

    Each layer's tensor has the model's page geometry (``model.kv_cache_shape``): MHA
    ``(2, num_pages, block_tokens, kv_heads, head_dim)``, MLA ``(num_pages, block_tokens, latent)``.

    Args:
        model: the model the cache serves.
        num_pages: pages per layer.
        block_tokens: tokens per page.
        device: where the tensors live.
        dtype: KV element type (the model's compute dtype).

    Raises:
        CapacityError: the tensors do not fit on the device.
    """

    def __init__(self, model: Model, num_pages: int, block_tokens: int, *,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> None:
        import torch  # here, not at the top: the allocator above must stay importable without torch

        self.num_pages = num_pages
        self.block_tokens = block_tokens
        shape = model.kv_cache_shape(num_pages, block_tokens)
        dtype = dtype if dtype is not None else next(model.parameters()).dtype
        try:
            self.layers: list[torch.Tensor] = [
                torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.config.num_layers)]
        except torch.cuda.OutOfMemoryError as exc:  # CPU allocation failures stay RuntimeError
            raise CapacityError(f"{num_pages} KV pages of shape {shape} do not fit on {device}") from exc

    @staticmethod
    def bytes_per_page(model: Model, block_tokens: int, dtype: torch.dtype) -> int:
        """Bytes one page of ``model`` takes over all layers (to size a cache before making it)."""
        import torch

        shape = model.kv_cache_shape(1, block_tokens)
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size() * model.config.num_layers

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers."""
        return sum(t.nbytes for t in self.layers) // self.num_pages

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache."""
        return sum(t.nbytes for t in self.layers)
