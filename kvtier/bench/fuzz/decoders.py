"""Input adapters of `kvtier bench fuzz` for decoders whose input is not a raw byte string.

Each adapter shapes fuzzer bytes into what the decoder receives on its real input path (a
decoded msgpack map for a namespace, argv text for a size flag, a file for the TOML config, ...)
and then calls the decoder and the checks that follow it there. When the bytes cannot be shaped
(the env target needs a map), :class:`NotAnInput` skips them: only inputs that reach the decoder
are counted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgpack

from kvtier_protocol import event_transport, keys, messages, wire_checks
from kvtier_protocol.errors import KVTierError
from kvtier_protocol.frame_codec import DEFAULT_LIMITS
from kvtier_protocol.namespace import Namespace

BLOCK_MAX_BYTES = 4 << 20
"""Largest payload and decoded tensor the block target accepts (bounds one input's work)."""
BLOCK_LAYOUTS = (None, "canonical", "vllm-nhc", "vllm-flash", "sglang-page-head", "mla-latent",
                 "sglang-mla-page-first")


class NotAnInput(Exception):
    """The bytes cannot be shaped into the decoder's input type; the input is skipped."""


def run_all(*calls: Callable[[], Any]) -> None:
    """Run every call (each is one decoder on the same input); re-raise the first typed error
    after all ran. Any other exception propagates at once: it is a crash."""
    first: KVTierError | None = None
    for call in calls:
        try:
            call()
        except KVTierError as exc:
            first = first or exc
    if first is not None:
        raise first


def run_any(*calls: Callable[[], Any]) -> None:
    """Run every call (decoders of the same bytes as different receivers take them); the input is
    accepted when one accepts it, else the first typed error is raised. Any other exception
    propagates at once: it is a crash."""
    first: KVTierError | None = None
    accepted = False
    for call in calls:
        try:
            call()
            accepted = True
        except KVTierError as exc:
            first = first or exc
    if not accepted and first is not None:
        raise first


def _harness_unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError):
        raise NotAnInput("not msgpack") from None


def _text(value: Any) -> str:
    """Text as a process receives it (argv, environment): no NUL, undecodable bytes escaped."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "surrogateescape")
    elif not isinstance(value, str):
        value = str(value)
    return value.replace("\x00", "")


# --- protocol ------------------------------------------------------------------------------------


def decode_block_input(data: bytes) -> None:
    """A whole block record through ``decode_block`` into one of several layouts."""
    from kvtier_protocol.block import decode_block  # imported by build_targets: not timed here

    layout = BLOCK_LAYOUTS[len(data) % len(BLOCK_LAYOUTS)]
    decode_block(data, layout=layout, max_payload_len=BLOCK_MAX_BYTES)


def zmq_input(data: bytes) -> None:
    """ZMQ multipart frames (a msgpack array of byte strings) through every event-frame parser."""
    parts = _harness_unpack(data)
    # recv_multipart hands over a list of byte strings, nothing else
    if not isinstance(parts, list) or not all(isinstance(p, (bytes, str)) for p in parts):
        raise NotAnInput("frames are a list of byte strings")
    frames = [p.encode("utf-8", "surrogatepass") if isinstance(p, str) else p for p in parts]
    # Each parser is one socket's receiver (SUB: live; ROUTER: replay requests; DEALER: replies;
    # the topic of any): a message is valid when the receiver of its kind takes it, so a valid
    # live message is accepted although the replay parsers refuse it.
    run_any(lambda: event_transport.parse_live_message(frames),
            lambda: event_transport.parse_replay_request(frames),
            lambda: event_transport.parse_replay_reply(frames),
            lambda: event_transport.parse_topic(frames[0] if frames else b""))


def namespace_input(data: bytes) -> None:
    """A namespace map (as headers' ``ns_fields`` carry it) through ``Namespace.from_wire``; a
    valid one is then hashed and used to key a few blocks."""
    ns = Namespace.from_wire(_harness_unpack(data))
    ns.canonical_bytes()
    if ns.block_tokens <= 1024:  # hashing 128K tokens per input would only measure SHA-256
        ns.block_keys(list(range(2 * ns.block_tokens)))


def _extras(m: Any) -> keys.ExtraKeys | None:
    if m is None:
        return None
    if not isinstance(m, dict):
        raise NotAnInput("extras are a map")
    items = m.get("mm_items", ())
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 3 for i in items):
        raise NotAnInput("mm items are [id, offset, length]")
    embeds = m.get("prompt_embeds", ())
    return keys.ExtraKeys(lora_name=m.get("lora_name"), lora_path=m.get("lora_path", ""),
                          mm_items=tuple(keys.MMItem(*i) for i in items), cache_salt=m.get("cache_salt"),
                          prompt_embeds=tuple(embeds) if isinstance(embeds, list) else embeds)


def keys_input(data: bytes) -> None:
    """Token ids, digests, hex keys and per-key arrays through the key functions that take them
    from requests (chain hashing, hex and event forms, the wire checkers of hashes and tokens)."""
    m = _harness_unpack(data)
    if not isinstance(m, dict):
        raise NotAnInput("a map of key inputs")
    tokens, scheme = m.get("tokens", []), m.get("scheme", keys.DEFAULT_SCHEME)
    extras = _extras(m.get("extras"))
    limits = DEFAULT_LIMITS
    # A request carries some of these inputs, not all: each function runs on the fields present
    # (an absent field is no input of it), so a valid request is accepted as a whole.
    calls: list[Callable[[], Any]] = []
    if "tokens" in m:
        calls += [lambda: keys.chain_hashes(tokens, m.get("hash_tokens", 16), scheme=scheme, extras=extras,
                                            parent=m.get("parent"), start=m.get("start", 0)),
                  lambda: keys.hash_block_tokens(m.get("parent"), tokens, m.get("extra"), scheme=scheme)]
    if "hex" in m:
        calls.append(lambda: keys.from_hex(m["hex"]))
    if "digest" in m:
        calls += [lambda: keys.to_hex(m["digest"]), lambda: keys.event_hash(m["digest"]),
                  lambda: keys.check_chain_hash(m["digest"], scheme)]
    if "units" in m:
        calls += [lambda: keys.block_keys(list(m["units"]) if isinstance(m["units"], list) else [],
                                          m.get("per", 1)),
                  lambda: wire_checks.hashes("hashes", m["units"], limits)]
    if "token_lists" in m:
        calls.append(lambda: messages.token_lists("tokens", m["token_lists"], limits))
    if "unit_lists" in m:
        calls.append(lambda: messages.unit_hash_lists("unit_hashes", m["unit_lists"], limits))
    if not calls:
        raise NotAnInput("a map naming no key input")
    run_all(*calls)


# --- REST ------------------------------------------------------------------------------------------


def rest_body_input(ns: Namespace) -> Callable[[bytes], None]:
    """A REST request body (and the query and path values it may name) through the parsing the
    REST handlers do: JSON object, ns, token ids (hashed in ``ns`` as /v1/lookup does), fix flag,
    tier, limit, cursor, hex keys."""
    from kvtier.daemon.server import rest_views as views

    key_len = 16 + 32

    def check_fix(body: dict[str, Any]) -> None:
        if not isinstance(body.get("fix", False), bool):
            from kvtier_protocol.errors import InvalidRequest
            raise InvalidRequest("fix must be true or false")

    def lookup(body: dict[str, Any]) -> None:
        ns_id = views.parse_ns(body.get("ns"))
        tokens = views.parse_token_ids(body.get("token_ids"))
        if ns_id == ns.ns_id:
            ns.block_keys(tokens)

    def query(body: dict[str, Any]) -> None:
        q, p = body.get("query"), body.get("path")
        q = {str(k): _text(v) for k, v in q.items()} if isinstance(q, dict) else {}
        p = {str(k): _text(v) for k, v in p.items()} if isinstance(p, dict) else {}
        run_all(lambda: views.parse_ns(q["ns"]) if "ns" in q else None,
                lambda: views.parse_tier(q.get("tier")),
                lambda: views.parse_limit(q.get("limit")),
                lambda: views.decode_cursor(q.get("cursor"), key_len),
                lambda: views.parse_ns(p.get("ns")),
                lambda: views.parse_hex(p.get("hash"), "hash", 32))

    def run(data: bytes) -> None:
        body = views.parse_json_object(data)
        calls = [lambda: check_fix(body)]
        if "ns" in body or "token_ids" in body:
            calls.append(lambda: lookup(body))
        if "query" in body or "path" in body:
            calls.append(lambda: query(body))
        run_all(*calls)
    return run


# --- configuration and command line -------------------------------------------------------------


def toml_input(work: str) -> Callable[[bytes], None]:
    """A TOML config file through ``load_config`` (defaults resolved inside ``work``)."""
    from kvtier.daemon.config import load_config

    path = os.path.join(work, "fuzz.toml")
    env = {"HOME": work, "XDG_RUNTIME_DIR": work}
    os.makedirs(work, exist_ok=True)

    def run(data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
        load_config(path, env=env)
    return run


def env_input(work: str) -> Callable[[bytes], None]:
    """``KVTIER_*`` variables (a msgpack map) through ``load_config``'s environment layer."""
    from kvtier.daemon.config import load_config

    def run(data: bytes) -> None:
        m = _harness_unpack(data)
        if not isinstance(m, dict):
            raise NotAnInput("an environment is a map")
        env = {"HOME": work, "XDG_RUNTIME_DIR": work}
        env.update({_text(k): _text(v) for k, v in m.items() if _text(k)})
        load_config(None, env=env)
    return run


def size_input(data: bytes) -> None:
    """Command-line text through ``parse_size`` and ``split_hostport`` (what the size and address
    flags of ``kvtier serve`` use) and through one flag override of ``load_config``."""
    from kvtier.daemon.config import OPTIONS, load_config, parse_size, split_hostport

    text = _text(data)
    options = sorted(OPTIONS)
    option = options[len(data) % len(options)]
    run_all(lambda: parse_size(text), lambda: split_hostport(text),
            lambda: load_config(None, env={"HOME": "/nonexistent"}, overrides={option: text}))
