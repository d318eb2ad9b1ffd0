"""One block record <-> one torch tensor (SPEC.md §4, §5, §6).

``encode_block`` turns a block tensor (any layout of ``kvtier_protocol.layouts``) into a whole
record: header + payload. With codec ``raw`` the payload is the tensor's bytes in the given
layout: one device-to-host copy (if on a GPU) and one copy into the record, no other CPU work.
A quantizing codec works on the canonical layout, so the block is converted first and the header
records ``canonical`` (or ``mla-latent``); ``decode_block`` converts back to the layout the caller
asks for.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import xxhash

from kvtier_protocol import codecs
from kvtier_protocol.codec_plan import SCALE_SIZE
from kvtier_protocol.compression import ALGORITHMS, compress_sections, decompress_sections
from kvtier_protocol.dtypes import DTYPE_SIZES
from kvtier_protocol.errors import CodecError, LayoutError
from kvtier_protocol.header import (COPY_CHUNK, DEFAULT_MAX_PAYLOAD_LEN, BlockHeader, Section, encode_header,
                                    payload_checksum, split_record, verify_payload)
from kvtier_protocol.layouts import Layout, convert, get_layout, to_canonical
from kvtier_protocol.quant import QuantParams

_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in _TORCH_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name.

    Raises:
        CodecError: unknown name.
    """
    try:
        return _TORCH_DTYPES[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown dtype {name!r}; expected one of {sorted(_TORCH_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype.

    Raises:
        CodecError: a dtype the wire format does not carry (e.g. float64).
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} is not a wire dtype; expected one of {sorted(_TORCH_DTYPES)}") from None


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` as a flat uint8 array on the host (a view when already contiguous on CPU)."""
    t = t.detach().contiguous()  # gather a strided view on its own device, then one transfer
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8).numpy()


def encode_block(tensor: torch.Tensor, *, ns_id: bytes, chain_hash: bytes, parent_hash: bytes | None,
                 layout: str | Layout, codec: str = "raw", quant: QuantParams | None = None,
                 num_tokens: int | None = None, ns_fields: dict | None = None,
                 created_ms: int | None = None, mla_rope_dim: int = 0,
                 compression: str | None = None) -> bytes:
    """Encode one block into a whole record (header + payload).

    Args:
        tensor: the block, on any device, in ``layout`` (e.g. ``[L, 2, H, T, D]`` for canonical).
        ns_id: the namespace id (16 bytes).
        chain_hash: the block's chain hash (8..64 bytes).
        parent_hash: the previous block's chain hash, or None for the first block.
        layout: the layout of ``tensor``.
        codec: ``"raw"`` or a quantizing codec of :mod:`kvtier_protocol.codecs`.
        quant: codec parameters (None: the codec's defaults); must be None for raw.
        num_tokens: if given, checked against the tensor's token axis.
        ns_fields: optionally, the full namespace map to record in the header.
        created_ms: optionally, the creation time to record (Unix ms).
        mla_rope_dim: MLA only: trailing latent dims that hold RoPE; with ``quant=None`` they are
            kept raw by the codec's defaults (the namespace's ``mla_rope_dim``).
        compression: ``"lz4"`` to byte-shuffle and LZ4-compress each section after the codec
            (SPEC.md §4.8; sections LZ4 does not shrink are stored verbatim); None for none.

    Raises:
        LayoutError: unknown layout, a shape that does not fit it, or a wrong ``num_tokens``.
        CodecError: an unsupported dtype, unknown codec, or data the codec refuses (NaN/Inf).
        HeaderError: invalid hashes or namespace id.
    """
    stored, header, _ = _encode(tensor, ns_id=ns_id, chain_hash=chain_hash, parent_hash=parent_hash,
                                layout=layout, codec=codec, quant=quant, num_tokens=num_tokens,
                                ns_fields=ns_fields, created_ms=created_ms, mla_rope_dim=mla_rope_dim,
                                compression=compression)
    return b"".join([header, *stored])


def _encode(tensor: torch.Tensor, *, ns_id: bytes, chain_hash: bytes, parent_hash: bytes | None,
            layout: str | Layout, codec: str, quant: QuantParams | None, num_tokens: int | None,
            ns_fields: dict | None, created_ms: int | None, mla_rope_dim: int, compression: str | None,
            alloc: Callable[[int], memoryview] | None = None) -> tuple[list, bytes, int]:
    """encode_block's work: ``(stored sections, header bytes, checksum)``. With ``alloc``, the
    stored payload is one buffer of it (``stored == [buffer]``), its checksum that of the buffer
    itself."""
    lay = get_layout(layout)
    dtype = dtype_name(tensor.dtype)
    lay.geometry_of(tuple(tensor.shape))
    direct = None  # the payload already in a buffer of alloc: (view, section lengths)
    if codec == "raw":
        if quant is not None:
            raise CodecError("codec raw takes no quant parameters")
        parts = [("payload", _host_bytes(tensor))]
        out_layout, shape, used_quant = lay.name, tuple(tensor.shape), None
    else:
        canonical = to_canonical(tensor, lay)
        if quant is None and lay.is_mla:
            quant = codecs.default_quant(codec, mla=True, rope_dims=mla_rope_dim)
        # the sections into one buffer (the C loops' one pass): the destination itself when nothing
        # follows the codec (no join, no second copy), else a buffer the compression stage reads
        into = alloc if alloc is not None and compression is None else bytearray
        view, lengths, used_quant = codecs.encode_into(canonical, codec, quant, mla=lay.is_mla, alloc=into)
        if into is alloc:
            direct = (view, lengths)
        mv, off, parts = memoryview(view), 0, []
        for name, n in lengths:
            parts.append((name, mv[off:off + n]))
            off += n
        out_layout, shape = lay.canonical_name, tuple(canonical.shape)
    tokens = shape[get_layout(out_layout).token_axis]
    if num_tokens is not None and num_tokens != tokens:
        raise LayoutError(f"num_tokens {num_tokens} != {tokens} tokens along the layout's token axis")
    comp = None
    sections, offset = [], 0
    if direct is not None:
        view, lengths = direct
        for name, n in lengths:
            sections.append(Section(name, offset, n))
            offset += n
        stored: list = [view]
        checksum = payload_checksum(view)  # of the destination: what is hashed is what is kept
    else:
        stored = [memoryview(arr) for _, arr in parts]
        if compression is not None:
            if compression not in ALGORITHMS:
                raise CodecError(f"unknown compression {compression!r}; expected one of {ALGORITHMS}")
            stored, comp = compress_sections(stored, [section_stride(name, dtype, used_quant) for name, _ in parts])
        digest = xxhash.xxh3_64()
        if alloc is None:
            for (name, _), data in zip(parts, stored):
                n = memoryview(data).nbytes
                sections.append(Section(name, offset, n))
                offset += n
                digest.update(data)
        else:  # one buffer of alloc, each chunk hashed right after it is copied (still in cache)
            lengths = [memoryview(data).nbytes for data in stored]
            view = memoryview(buf := alloc(sum(lengths)))
            for (name, _), data, n in zip(parts, stored, lengths):
                sections.append(Section(name, offset, n))
                src = memoryview(data).cast("B")
                for off in range(0, n, COPY_CHUNK):
                    part = view[offset + off:offset + min(n, off + COPY_CHUNK)]
                    part[:] = src[off:off + COPY_CHUNK]
                    digest.update(part)
                offset += n
            stored = [buf]
        checksum = digest.intdigest()
    header = BlockHeader(ns_id=ns_id, chain_hash=chain_hash, parent_hash=parent_hash,
                         num_tokens=tokens, layout=out_layout, shape=shape, dtype=dtype, codec=codec,
                         sections=tuple(sections), payload_len=offset, checksum=checksum,
                         quant=used_quant, ns_fields=ns_fields, created_ms=created_ms, compression=comp)
    return stored, encode_header(header), checksum


def encode_block_into(tensor: torch.Tensor, *, alloc: Callable[[int], memoryview], ns_id: bytes,
                      chain_hash: bytes, parent_hash: bytes | None, layout: str | Layout, codec: str = "raw",
                      quant: QuantParams | None = None, num_tokens: int | None = None,
                      ns_fields: dict | None = None, created_ms: int | None = None, mla_rope_dim: int = 0,
                      compression: str | None = None) -> tuple[bytes, memoryview, int]:
    """:func:`encode_block` with the payload written into a buffer of ``alloc`` (e.g. a disk
    tier's page-aligned pool): ``header + payload`` is :func:`encode_block`'s record byte for byte.

    The quantizing codecs encode straight into the buffer (:func:`kvtier_protocol.codecs.encode_into`);
    raw and compressed payloads are copied in, each chunk hashed as it is written. Either way the
    header's checksum is the xxh3-64 of the buffer itself, so the bytes kept are the bytes hashed.

    Args:
        alloc: ``alloc(nbytes)`` returns a writable, C-contiguous byte view of ``nbytes`` bytes; it
            may be called more than once (see :func:`~kvtier_protocol.codecs.encode_into`): only
            the view returned is in use, the earlier ones are free again.
        the others: as for :func:`encode_block`.

    Returns:
        The header bytes, the payload (the view from ``alloc``), and its checksum.

    Raises:
        As :func:`encode_block` (after which no view of ``alloc`` is in use).
    """
    stored, header, checksum = _encode(tensor, ns_id=ns_id, chain_hash=chain_hash, parent_hash=parent_hash,
                                       layout=layout, codec=codec, quant=quant, num_tokens=num_tokens,
                                       ns_fields=ns_fields, created_ms=created_ms, mla_rope_dim=mla_rope_dim,
                                       compression=compression, alloc=alloc)
    return header, stored[0], checksum


def section_stride(section: str, dtype: str, quant: QuantParams | None) -> int:
    """The shuffle stride of a section: the size of its elements (SPEC.md §4.8)."""
    if section in ("scales", "mins"):
        assert quant is not None, "only quantized records have scales"
        return SCALE_SIZE[quant.scale_dtype]
    if section == "payload" and quant is not None:
        return 1  # integer or fp8 codes, a byte (or less) each
    return DTYPE_SIZES[dtype]  # a raw payload or MLA's rope: the block's elements


def _raw_tensor(h: BlockHeader, payload: memoryview, device: str | torch.device) -> torch.Tensor:
    # Copy out of the record: the caller's buffer (often a shared-memory slot) is released after
    # this call, and torch cannot wrap a read-only buffer without a warning.
    out = torch.empty(payload.nbytes, dtype=torch.uint8)
    out.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
    return out.to(device).view(torch_dtype(h.dtype)).reshape(h.shape)


def decode_block(buf: bytes | bytearray | memoryview, *, layout: str | Layout | None = None,
                 device: str | torch.device = "cpu", verify: bool = True,
                 max_payload_len: int = DEFAULT_MAX_PAYLOAD_LEN) -> tuple[BlockHeader, torch.Tensor]:
    """Decode one whole record into its header and block tensor.

    Args:
        buf: the record (exactly one; it is not retained).
        layout: the layout wanted; None returns the stored layout (``header.layout``).
        device: where the tensor is built; layout conversion runs there.
        verify: check the payload's xxh3-64 first (skip only for bytes verified just before).
        max_payload_len: refuse larger payloads and decoded tensors (LimitExceeded).

    Returns:
        The header and a contiguous tensor owning its memory.

    Raises:
        Only KVTierError subclasses: the header's errors, ChecksumMismatch, CodecError, LayoutError.
    """
    h, payload = split_record(buf, max_payload_len=max_payload_len)
    if verify:
        verify_payload(h, payload)
    stored = get_layout(h.layout)
    views = {s.name: payload[s.offset:s.offset + s.length] for s in h.sections}
    if h.compression is not None:  # verified as stored, then decompressed (SPEC 4.8)
        views = dict(zip(views, decompress_sections(h.compression, list(views.values()))))
    if h.codec == "raw":
        tensor = _raw_tensor(h, views["payload"], device)
    else:
        if stored.name != stored.canonical_name:
            # The codecs' geometry is that of the canonical layouts; read in any other axis order
            # the same shape would decode to the wrong elements (SPEC 5.1, 6.5).
            raise CodecError(f"codec {h.codec!r} needs layout {stored.canonical_name!r}, "
                             f"got {h.layout!r}")
        tensor = codecs.decode(views, codec=h.codec, quant=h.quant, shape=h.shape, dtype=h.dtype,
                               mla=stored.is_mla, device=device)
    if layout is not None:
        tensor = convert(tensor, stored, layout)
    return h, tensor
