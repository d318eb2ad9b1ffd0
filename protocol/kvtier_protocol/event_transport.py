"""ZMQ multipart framing of KV events, as vLLM 0.33's ``ZmqEventPublisher`` (SPEC.md §9.4).

Pure bytes: these helpers build and parse the frame lists that a ``zmq`` socket sends with
``send_multipart`` and returns from ``recv_multipart``; nothing here imports zmq.

- live (PUB):             ``[topic, seq u64 BE, payload]``, seq counting from 0 per publisher
- replay request:         client DEALER sends ``[b"", start_seq u64 BE]``; the ROUTER sees
                          ``[identity, b"", start_seq]``
- replay reply (ROUTER):  ``[identity, b"", topic, seq, payload]`` per buffered seq >= start
- replay end (ROUTER):    ``[identity, b"", b"", (-1) as i64 BE, b""]``

Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier_protocol.errors import EventError

Buffer = bytes | bytearray | memoryview
SEQ_LEN = 8
REPLAY_END_SEQ = (-1).to_bytes(SEQ_LEN, "big", signed=True)
TOPIC_PREFIX = "kv"
_SEQ_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class LiveMessage:
    """One published batch: topic, sequence number, msgpack payload (see ``decode_batch``)."""

    topic: str
    seq: int
    payload: bytes


def make_topic(pod: str, model: str) -> str:
    """The llm-d topic ``kv@<pod>@<model>`` (llm-d splits it on ``@``).

    Raises:
        EventError: ``pod`` or ``model`` is empty or contains ``@``.
    """
    for part in (pod, model):
        if not isinstance(part, str) or not part or "@" in part:
            raise EventError(f"topic parts must be non-empty strings without '@': {part!r}")
    return f"{TOPIC_PREFIX}@{pod}@{model}"


def parse_topic(value: str | Buffer) -> tuple[str, str]:
    """Split ``kv@<pod>@<model>`` into ``(pod, model)``.

    Raises:
        EventError: not UTF-8, or not of that form.
    """
    text = _utf8(value)
    parts = text.split("@")
    if len(parts) != 3 or parts[0] != TOPIC_PREFIX or not parts[1] or not parts[2]:
        raise EventError(f"topic {text!r} is not kv@<pod>@<model>")
    return parts[1], parts[2]


def _utf8(value: str | Buffer) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except (UnicodeDecodeError, TypeError) as exc:
        raise EventError("topic is not UTF-8") from exc


def _seq_bytes(seq: int) -> bytes:
    if type(seq) is not int or not 0 <= seq <= _SEQ_MAX:
        raise EventError(f"sequence numbers are unsigned 64-bit integers, got {seq!r}")
    return seq.to_bytes(SEQ_LEN, "big")


def _seq(value: Buffer) -> int:
    raw = bytes(value)
    if len(raw) != SEQ_LEN:
        raise EventError(f"a sequence number is {SEQ_LEN} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


def _frames(frames: Sequence[Buffer], what: str) -> list[bytes]:
    try:
        return [bytes(f) for f in frames]
    except TypeError as exc:
        raise EventError(f"{what}: frames must be byte strings") from exc


def live_message(topic: str | bytes, seq: int, payload: Buffer) -> list[bytes]:
    """The three frames of a live message."""
    name = topic.encode("utf-8") if isinstance(topic, str) else bytes(topic)
    return [name, _seq_bytes(seq), bytes(payload)]


def parse_live_message(frames: Sequence[Buffer]) -> LiveMessage:
    """Parse the frames a SUB socket received.

    Raises:
        EventError: not exactly three frames, a sequence that is not 8 bytes, a non-UTF-8 topic.
    """
    parts = _frames(frames, "live message")
    if len(parts) != 3:
        raise EventError(f"a live message has 3 frames, got {len(parts)}")
    return LiveMessage(_utf8(parts[0]), _seq(parts[1]), parts[2])


def replay_request(start_seq: int) -> list[bytes]:
    """Frames a DEALER sends to ask for every buffered batch with seq >= ``start_seq``."""
    return [b"", _seq_bytes(start_seq)]


def parse_replay_request(frames: Sequence[Buffer]) -> tuple[bytes, int]:
    """Parse what the ROUTER received: returns ``(identity, start_seq)``.

    Raises:
        EventError: not ``[identity, b"", start_seq]``.
    """
    parts = _frames(frames, "replay request")
    if len(parts) != 3 or parts[1] != b"":
        raise EventError("a replay request is [identity, b'', start_seq]")
    return parts[0], _seq(parts[2])


def replay_reply(identity: Buffer, topic: str | bytes, seq: int, payload: Buffer) -> list[bytes]:
    """Frames the ROUTER sends for one buffered batch."""
    return [bytes(identity), b"", *live_message(topic, seq, payload)]


def replay_end(identity: Buffer) -> list[bytes]:
    """Frames the ROUTER sends after the last buffered batch."""
    return [bytes(identity), b"", b"", REPLAY_END_SEQ, b""]


def parse_replay_reply(frames: Sequence[Buffer]) -> LiveMessage | None:
    """Parse what the DEALER received: a batch, or None for the end marker.

    Accepts the frames with or without the leading empty delimiter (REQ sockets strip it).

    Raises:
        EventError: neither a replayed batch nor the end marker.
    """
    parts = _frames(frames, "replay reply")
    if len(parts) == 4 and parts[0] == b"":
        parts = parts[1:]
    if len(parts) != 3:
        raise EventError(f"a replay reply has 3 frames after the delimiter, got {len(parts)}")
    if parts[1] == REPLAY_END_SEQ and parts[2] == b"":
        return None
    return LiveMessage(_utf8(parts[0]), _seq(parts[1]), parts[2])
