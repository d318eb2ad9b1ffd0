"""The decoders `kvtier bench fuzz` feeds: one :class:`Target` per decoder of untrusted input.

Each target runs one input (bytes) through a decoder exactly as the daemon, client or CLI would
call it, and the checks that follow it on that path (a decoded frame is validated as a request or
parsed as a response; a decoded header is split from its payload; ...). A typed error
(:class:`~kvtier_protocol.errors.KVTierError`) is the expected outcome for a bad input; anything
else is a crash. Seeds are the golden vectors in ``protocol/vectors`` plus a few built here.
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

import kvtier_protocol
from kvtier_protocol import event_transport, events, frames, header
from kvtier_protocol.namespace import Namespace

from kvtier.bench.fuzz import mutate as mut
from kvtier.bench.fuzz.decoders import (NotAnInput, decode_block_input, env_input, keys_input,
                                        namespace_input, rest_body_input, size_input, toml_input,
                                        zmq_input)

VECTORS = Path(kvtier_protocol.__file__).resolve().parents[1] / "vectors"
CONFIG_EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "kvtier.toml"


@dataclass(slots=True)
class Target:
    """One decoder under fuzzing.

    Attributes:
        name: the row name (``frames.decode_frame``, ``config.toml`` ...).
        run: feeds one input to the decoder; raises what the decoder raises.
        seeds: valid inputs to mutate.
        structured: decodes a seed, mutates the structure, encodes it with valid framing.
        raw_share: share of random and byte-mutated inputs; low for targets whose harness
            needs a structure (a msgpack map) that random bytes rarely are.
        close: releases what ``run`` holds (an event loop).
    """

    name: str
    run: Callable[[bytes], Any]
    seeds: list[bytes]
    structured: Callable[[random.Random, bytes], bytes] | None = None
    raw_share: float = 0.45  # share of random and byte-mutated inputs (the rest: structured)
    close: Callable[[], None] = field(default=lambda: None)


def _vectors(area: str, ext: str = ".bin") -> list[bytes]:
    folder = VECTORS / area
    return [p.read_bytes() for p in sorted(folder.glob(f"*{ext}"))] if folder.is_dir() else []


# --- frames ------------------------------------------------------------------------------------


def _check_frame(frame: frames.Frame) -> None:
    """What the daemon does with a request frame, and a client with a response frame."""
    if "ok" in frame.header:
        op = frame.op if frame.op in frames.OPS else "get"
        frames.parse_response(op, frame)
    else:
        frames.validate_request(frame)


def _decode_frame(data: bytes) -> None:
    _check_frame(frames.decode_frame(data))


CHUNKS = (1, 3, 7, 20, 64, 333, 4096)


def _frame_decoder(data: bytes) -> None:
    dec = frames.FrameDecoder()
    pos, i = 0, len(data)
    while pos < len(data):
        step = CHUNKS[(i + pos) % len(CHUNKS)]
        for frame in dec.feed(data[pos:pos + step]):
            _check_frame(frame)
        pos += step


class _StreamTarget:
    """``read_frame`` over an asyncio StreamReader holding the input, until the clean end."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    async def _read_all(self, data: bytes) -> None:
        reader = asyncio.StreamReader(limit=1 << 16)
        reader.feed_data(data)
        reader.feed_eof()
        while (frame := await frames.read_frame(reader)) is not None:
            _check_frame(frame)

    def __call__(self, data: bytes) -> None:
        self.loop.run_until_complete(self._read_all(data))

    def close(self) -> None:
        self.loop.close()


def _frame_parts(seed: bytes) -> tuple[int, Any, bytes]:
    _, _, flags, hlen, _ = frames.PREAMBLE.unpack_from(seed)
    return flags, mut.unpack_trusted(seed[20:20 + hlen]), seed[20 + hlen:]


def structured_frame(rng: random.Random, seed: bytes) -> bytes:
    """A seed frame with its header map mutated; lengths right most of the time."""
    flags, head, payload = _frame_parts(seed)
    head = mut.mutate_value(rng, head)
    if rng.random() < 0.2:
        payload = mut.mutate_bytes(rng, payload)
    body = mut.pack(head)
    hlen, plen = len(body), len(payload)
    if rng.random() < 0.1:
        hlen, plen = rng.choice(mut.INTERESTING_INTS) % (1 << 32), rng.choice(mut.INTERESTING_INTS) % (1 << 64)
    if rng.random() < 0.1:
        flags = rng.randrange(1 << 16)
    return frames.PREAMBLE.pack(frames.MAGIC, frames.FRAME_VERSION, flags, hlen, plen) + body + payload


# --- block records ----------------------------------------------------------------------------


def _decode_header(data: bytes) -> None:
    header.decode_header(data)
    header.split_record(data)


def structured_record(rng: random.Random, seed: bytes) -> bytes:
    """A seed record with its header map mutated, re-framed with the right length and header
    checksum (and often the right ``plen`` and payload ``csum``), so the mutation reaches the
    header validator and the codecs instead of failing the header checksum."""
    hlen = struct.unpack_from("<I", seed, 8)[0]
    m = mut.unpack_trusted(seed[20:20 + hlen])
    payload = seed[20 + hlen:]
    m = mut.mutate_value(rng, m)
    if rng.random() < 0.2:
        payload = mut.mutate_bytes(rng, payload)
    if isinstance(m, dict) and rng.random() < 0.7:
        m["plen"] = len(payload)
        m["csum"] = xxhash.xxh3_64_intdigest(payload)
    body = mut.pack(m)
    digest = xxhash.xxh3_64_intdigest(body) if rng.random() < 0.95 else rng.getrandbits(64)
    return header.PREAMBLE.pack(header.MAGIC, header.VERSION, 0, len(body), digest) + body + payload


# --- msgpack documents ----------------------------------------------------------------------------


def structured_msgpack(rng: random.Random, seed: bytes) -> bytes:
    """A seed msgpack document with one structural change (or a deeply nested one)."""
    if rng.random() < 0.03:
        return mut.pack(mut.nested(rng))
    return mut.pack(mut.mutate_value(rng, mut.unpack_trusted(seed)))


def structured_json(rng: random.Random, seed: bytes) -> bytes:
    doc = json.loads(seed)
    if rng.random() < 0.03:
        return mut.dump_json(rng, mut.nested(rng))
    return mut.dump_json(rng, mut.mutate_value(rng, doc))


def structured_toml(rng: random.Random, seed: bytes) -> bytes:
    import tomllib

    if rng.random() < 0.02:
        return mut.deep_toml(rng)
    doc = tomllib.loads(seed.decode())
    for _ in range(rng.choice((1, 1, 2, 3))):
        doc = mut.mutate_value(rng, doc)
    return mut.dump_toml(doc if isinstance(doc, dict) else {"x": doc})


FUZZ_NS = Namespace(model="fuzz/model", revision="r1", attention="mha", num_layers=2, num_kv_heads=2, head_dim=8,
                    kv_dtype="float16", block_tokens=16, hash_tokens=4)
MLA_NS = Namespace(model="fuzz/mla", revision="sha256:00", attention="mla", num_layers=2, num_kv_heads=1,
                   head_dim=16, mla_rope_dim=4, kv_dtype="bfloat16", kv_codec="int8", block_tokens=8,
                   hash_tokens=8, hash_scheme="sglang-sha256-u32le", tp_rank=1, tp_size=2, tenant_salt="s")


def _seeds_event_frames() -> list[bytes]:
    batch = _vectors("events")[0] if _vectors("events") else mut.pack([0.0, []])
    return [mut.pack(parts) for parts in (
        event_transport.live_message("kv@pod@model", 7, batch),
        [b"ident", *event_transport.replay_request(3)],
        event_transport.replay_reply(b"ident", "kv@pod@model", 9, batch),
        event_transport.replay_end(b"ident"),
        ["kv@pod@model"],
    )]


def _seeds_keys() -> list[bytes]:
    toks = list(range(32))
    return [mut.pack(v) for v in (
        {"tokens": toks, "hash_tokens": 4, "scheme": "vllm-sha256-cbor", "extras": {"cache_salt": "s"}},
        {"tokens": toks, "hash_tokens": 8, "scheme": "sglang-sha256-u32le", "extras": {"lora_name": "l"}},
        {"tokens": toks[:16], "hash_tokens": 16, "scheme": "vllm-sha256-cbor", "parent": b"\x01" * 32,
         "start": 16, "extras": {"mm_items": [["img", 0, 4]], "prompt_embeds": [b"\x02" * 32]}},
        {"hex": "ab" * 32, "digest": b"\x05" * 32, "units": [b"\x03" * 32] * 4, "per": 2},
        {"token_lists": [toks[:16], None, toks[16:]], "unit_lists": [[b"\x04" * 32] * 2, None, [b"\x06" * 32]]},
        {"digest": b"\x07" * 32, "scheme": "sglang-sha256-u32le"},
    )]


def _seeds_rest() -> list[bytes]:
    tokens = list(range(40))
    return [json.dumps(v).encode() for v in (
        {"ns": FUZZ_NS.ns_id.hex(), "token_ids": tokens},
        {"ns": FUZZ_NS.ns_id.hex()},
        {"fix": True},
        {"query": {"ns": FUZZ_NS.ns_id.hex(), "tier": "host", "limit": "10", "cursor": "AQ" + "A" * 64},
         "path": {"ns": FUZZ_NS.ns_id.hex(), "hash": "cd" * 32}},
    )]


def _seeds_toml() -> list[bytes]:
    seeds = [b"[store]\nhost_bytes = \"64MiB\"\ndisk_bytes = 0\n[dataplane]\nlisten = \"127.0.0.1:0\"\n",
             b"[auth]\ntoken = \"0123456789abcdef0123\"\n[rest]\nlisten = \"off\"\n[events]\n"
             b"endpoint = \"tcp://127.0.0.1:5557\"\nbuffer_steps = 3\n",
             b"[tenants.alice]\nhost_bytes = \"8MiB\"\ndisk_bytes = 0\n[store]\nhost_bytes = \"8MiB\"\n"]
    if CONFIG_EXAMPLE.is_file():
        seeds.append(CONFIG_EXAMPLE.read_bytes())
    return seeds


def _seeds_env() -> list[bytes]:
    return [mut.pack(v) for v in (
        {"KVTIER_HOST_BYTES": "64MiB", "KVTIER_DISK_BYTES": "0", "KVTIER_LISTEN": "127.0.0.1:0"},
        {"KVTIER_STORE__WRITE_THROUGH": "yes", "KVTIER_DISK_BYTES": "1GiB", "KVTIER_REST": "off"},
        {"KVTIER_DATAPLANE__IDLE_TIMEOUT_S": "2.5", "KVTIER_TOKEN": "0123456789abcdef0123",
         "KVTIER_EVENTS": "tcp://127.0.0.1:1", "KVTIER_DAEMON__DRAIN_TIMEOUT_S": "0"},
    )]


SIZE_SEEDS = [s.encode() for s in ("4GiB", "1.5GiB", "20G", "512", "0.5KiB", " 7 mb ", "127.0.0.1:7470",
                                    "[::1]:0", ":80", "off", "auto")]


def build_targets(workdir: str | None = None) -> list[Target]:
    """Every target, with its seeds. ``workdir`` holds the config target's files (a temp dir)."""
    work = workdir or tempfile.mkdtemp(prefix="kvtier-fuzz-")
    frame_seeds = _vectors("frames")
    record_seeds = _vectors("blocks")
    event_seeds = _vectors("events")
    ns_seeds = [mut.pack(ns.to_wire()) for ns in (FUZZ_NS, MLA_NS)]
    stream = _StreamTarget()
    import kvtier_protocol.block  # noqa: F401 - torch imports here, not inside a timed input
    return [
        Target("frames.decode_frame", _decode_frame, frame_seeds, structured_frame),
        Target("frames.FrameDecoder", _frame_decoder, frame_seeds, structured_frame),
        Target("frames.read_frame", stream, frame_seeds, structured_frame, close=stream.close),
        Target("header.decode_header", _decode_header, record_seeds, structured_record),
        Target("block.decode_block", decode_block_input, record_seeds, structured_record),
        Target("events.decode_batch", lambda d: events.decode_batch(d, packed=True), event_seeds, structured_msgpack),
        Target("events.zmq_frames", zmq_input, _seeds_event_frames(), structured_msgpack, raw_share=0.1),
        Target("namespace.from_wire", namespace_input, ns_seeds, structured_msgpack, raw_share=0.1),
        Target("keys", keys_input, _seeds_keys(), structured_msgpack, raw_share=0.1),
        Target("rest.body", rest_body_input(FUZZ_NS), _seeds_rest(), structured_json),
        Target("config.toml", toml_input(work), _seeds_toml(), structured_toml),
        Target("config.env", env_input(work), _seeds_env(), structured_msgpack, raw_share=0.1),
        Target("cli.size", size_input, SIZE_SEEDS, None),
    ]
