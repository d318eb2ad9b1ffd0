"""Typed errors of the kvtier wire contract.

Every decoder of untrusted bytes raises only subclasses of :class:`KVTierError`. Each class has a
stable wire code (``code``, a short snake_case string) and a numeric ``status`` so that an error
raised in the daemon crosses the wire and is re-raised as the same class in the client
(:func:`error_from_wire`). The table is normative: protocol/SPEC.md §8 lists it.

Three levels of error handling apply across the project:

* ``assert`` with a message for internal invariants (never for input validation);
* these typed exceptions for callers and for the wire;
* ``None``/``False`` return values for "the cache is full" and "not found", which are not errors.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base of every error kvtier raises on purpose."""

    code: str = "internal"
    status: int = 1

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.code


# --- malformed or hostile input --------------------------------------------------------------


class ProtocolError(KVTierError):
    """Bytes that do not follow the wire format."""

    code = "protocol"
    status = 10


class BadMagic(ProtocolError):
    """The preamble does not start with the expected magic bytes."""

    code = "bad_magic"
    status = 11


class UnsupportedVersion(ProtocolError):
    """The preamble names a format version this implementation does not speak."""

    code = "unsupported_version"
    status = 12


class Truncated(ProtocolError):
    """The input ends before the lengths it declares."""

    code = "truncated"
    status = 13


class LimitExceeded(ProtocolError):
    """A declared length or count is above the configured limit; refused before allocating."""

    code = "limit_exceeded"
    status = 14


class HeaderError(ProtocolError):
    """A block header map is malformed: missing required key, wrong type, inconsistent values."""

    code = "bad_header"
    status = 15


class FrameError(ProtocolError):
    """A data-plane frame is malformed."""

    code = "bad_frame"
    status = 16


class EventError(ProtocolError):
    """A KV event batch is malformed."""

    code = "bad_event"
    status = 17


class ChecksumMismatch(KVTierError):
    """Stored or received bytes do not match their recorded checksum. Treated as a miss."""

    code = "checksum_mismatch"
    status = 20


# --- semantic errors of well-formed input ----------------------------------------------------


class CodecError(KVTierError):
    """A codec cannot encode or decode the given data (unknown codec, NaN/Inf, bad parameters)."""

    code = "codec"
    status = 30


class LayoutError(KVTierError):
    """A layout name, shape or conversion request is invalid."""

    code = "layout"
    status = 31


class NamespaceError(KVTierError):
    """A namespace is invalid, unknown, or a block does not match its namespace's geometry."""

    code = "namespace"
    status = 32


class InvalidKey(KVTierError):
    """A block key has the wrong length or type."""

    code = "invalid_key"
    status = 33


class InvalidRequest(KVTierError):
    """A well-formed request whose fields make no sense (unknown op, bad argument)."""

    code = "invalid_request"
    status = 34


# --- store and daemon ------------------------------------------------------------------------


class CapacityError(KVTierError):
    """A block can never fit: larger than the tier, or the tier has zero capacity."""

    code = "capacity"
    status = 40


class NotFound(KVTierError):
    """A named block, namespace or lease does not exist."""

    code = "not_found"
    status = 41


class LeaseError(KVTierError):
    """A lease is unknown, expired or held by someone else."""

    code = "lease"
    status = 42


class StorageError(KVTierError):
    """A tier's backing storage failed (I/O error, disk full)."""

    code = "storage"
    status = 43


class Unauthorized(KVTierError):
    """A token is missing or wrong."""

    code = "unauthorized"
    status = 50


class Busy(KVTierError):
    """A per-connection or global limit on in-flight work was reached; retry later."""

    code = "busy"
    status = 51


class Unavailable(KVTierError):
    """The daemon cannot be reached or did not answer in time."""

    code = "unavailable"
    status = 52


def _all_subclasses(cls: type[KVTierError]) -> list[type[KVTierError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[str, type[KVTierError]] = {c.code: c for c in _all_subclasses(KVTierError)}
ERRORS_BY_STATUS: dict[int, type[KVTierError]] = {c.status: c for c in _all_subclasses(KVTierError)}
assert len(ERRORS_BY_CODE) == len(ERRORS_BY_STATUS), "wire codes and statuses must be unique"


def error_from_wire(code: str, message: str) -> KVTierError:
    """Rebuild the typed error a peer sent; an unknown code becomes a plain :class:`KVTierError`."""
    cls = ERRORS_BY_CODE.get(code, KVTierError)
    err = cls(message)
    if cls is KVTierError:
        err.code = code if isinstance(code, str) else "internal"
    return err
