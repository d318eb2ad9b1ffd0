"""The service sections of the daemon's settings: ``[dataplane]``, ``[rest]``, ``[events]``, ``[auth]``,
``[remote]``.

Each is a frozen dataclass that checks its own fields when built (:class:`~kvtier.daemon.config.values.ConfigError`
names the option). Torch-free.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kvtier_protocol.codec_plan import CODECS

from kvtier.daemon.config.values import (MIB, MIN_TOKEN_LEN, UNIX_PATH_MAX, ConfigError, hostport_option, positive,
                                         typed)
from kvtier.daemon.remote.address import PREFIX, parse_cluster_url
from kvtier.daemon.store.config import K_AXES, TIER_COMPRESSIONS, CodecModels, StoreConfigError, check_codec_models


@dataclass(frozen=True, slots=True)
class DataPlaneConfig:
    """The data plane (the frame protocol of SPEC.md §7).

    Attributes:
        socket: path of the unix socket (mode 0600); None: no unix socket.
        listen: ``HOST:PORT`` of the TCP data plane (payloads inline, token required); None: off.
        socket_requires_token: ask for the token on the unix socket too (the file mode already
            limits it to the daemon's user).
        max_connections: unix-socket connections served at once; more are refused.
        max_tcp_connections: TCP connections served at once, counted apart, so TCP peers can
            never take the unix socket's places.
        max_unauthenticated: TCP connections that have not yet completed their hello; more are
            refused until one does or times out (the unix socket, reachable by the daemon's user
            only, is limited by max_connections alone).
        hello_timeout_s: a connection that has not completed its hello this long after it was
            accepted is closed.
        max_inflight: requests one connection may have outstanding (more: ``busy``).
        idle_timeout_s: a connection silent this long is closed.
        max_payload_bytes: largest frame payload (and block record).
        max_batch: most keys in one request.
        max_connection_buffer_bytes: frame payloads one connection may hold at once (received or
            being received, until their requests end); a frame beyond it waits for room.
        max_buffer_bytes: the same for all connections together.
    """

    socket: str | None
    listen: str | None = None
    socket_requires_token: bool = False
    max_connections: int = 256
    max_tcp_connections: int = 128
    max_unauthenticated: int = 16
    hello_timeout_s: float = 10.0
    max_inflight: int = 64
    idle_timeout_s: float = 300.0
    max_payload_bytes: int = 256 * MIB
    max_batch: int = 4096
    max_connection_buffer_bytes: int = 512 * MIB
    max_buffer_bytes: int = 1024 * MIB

    def __post_init__(self) -> None:
        if self.socket is not None:
            typed("dataplane.socket", self.socket, str)
            if not self.socket or len(os.fsencode(self.socket)) > UNIX_PATH_MAX:
                raise ConfigError(f"dataplane.socket must be a path of 1..{UNIX_PATH_MAX} bytes, got "
                                  f"{self.socket!r} (use a shorter data_dir or socket path)")
        object.__setattr__(self, "listen", hostport_option("dataplane.listen", self.listen))
        typed("dataplane.socket_requires_token", self.socket_requires_token, bool)
        for name in ("max_connections", "max_tcp_connections", "max_unauthenticated", "max_inflight",
                     "max_payload_bytes", "max_batch", "max_connection_buffer_bytes", "max_buffer_bytes"):
            positive(f"dataplane.{name}", getattr(self, name))
        positive("dataplane.idle_timeout_s", self.idle_timeout_s, number=True)
        positive("dataplane.hello_timeout_s", self.hello_timeout_s, number=True)
        # A frame's payload must fit both budgets, or it would wait for room forever.
        for name in ("max_connection_buffer_bytes", "max_buffer_bytes"):
            if getattr(self, name) < self.max_payload_bytes:
                raise ConfigError(f"dataplane.{name} ({getattr(self, name)}) must be at least "
                                  f"dataplane.max_payload_bytes ({self.max_payload_bytes})")
        if self.socket is None and self.listen is None:
            raise ConfigError("dataplane: both socket and listen are off; nothing would serve the data plane")


@dataclass(frozen=True, slots=True)
class RestConfig:
    """The REST API and ``/metrics``.

    Attributes:
        listen: ``HOST:PORT``, or None (off).
        public_reads: serve the store's contents (stats, tiers, namespaces, blocks, lookup,
            events) without a token; else they need a valid token (the admin's or a tenant's).
            Health, readiness, ``/metrics`` and the OpenAPI document are always public.
        public_tenant_metrics: ``/metrics`` shows every tenant's series without a token; else
            anonymous scrapes see only the default store's, the admin token all of them and a
            tenant's token its own.
        max_connections: REST connections open at once; more are closed as they are accepted
            (lowered at start when the descriptor limit leaves the data plane too few).
        header_timeout_s: time a connection has to deliver a request's headers (from its
            opening, or the end of its previous request); then it is closed.
        body_timeout_s: time a request's body has to arrive once the handler reads it.
    """

    listen: str | None = "127.0.0.1:7471"
    public_reads: bool = False
    public_tenant_metrics: bool = False
    max_connections: int = 64
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "listen", hostport_option("rest.listen", self.listen))
        typed("rest.public_reads", self.public_reads, bool)
        typed("rest.public_tenant_metrics", self.public_tenant_metrics, bool)
        positive("rest.max_connections", self.max_connections)
        positive("rest.header_timeout_s", self.header_timeout_s, number=True)
        positive("rest.body_timeout_s", self.body_timeout_s, number=True)


_ZMQ_ENDPOINT = re.compile(r"(tcp|ipc|inproc)://\S+")


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV events (SPEC.md §9): a ZMQ PUB socket and a replay ROUTER, vLLM 0.33 compatible.

    Attributes:
        endpoint: ZMQ endpoint of the PUB socket (``tcp://127.0.0.1:5557``); None: no publisher.
        replay_endpoint: ZMQ endpoint of the replay ROUTER; None: no replay.
        packed_endpoint: a second PUB endpoint with the same batches whose token ids are packed
            (SPEC.md §9.8: a msgpack bin of uint32s; kvtier's own subscribers decode it several
            times faster); None: none. The vLLM-compatible ``endpoint`` is unchanged by it.
        topic: topic of every message, ``kv@<pod>@<model>``; load_config computes
            ``kv@<hostname>@kvtier`` when it is empty.
        legacy_array: encode events as arrays (vLLM before map encoding) instead of maps.
        buffer_steps: batches kept for replay.
        hwm: ZMQ send high-water mark (messages).
    """

    endpoint: str | None = None
    replay_endpoint: str | None = None
    packed_endpoint: str | None = None
    topic: str = ""
    legacy_array: bool = False
    buffer_steps: int = 10000
    hwm: int = 100000

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint", "packed_endpoint"):
            value = getattr(self, name)
            if value is not None and not _ZMQ_ENDPOINT.fullmatch(typed(f"events.{name}", value, str)):
                raise ConfigError(f"events.{name} must be a ZMQ endpoint such as tcp://127.0.0.1:5557, got {value!r}")
        typed("events.topic", self.topic, str)
        typed("events.legacy_array", self.legacy_array, bool)
        positive("events.buffer_steps", self.buffer_steps)
        positive("events.hwm", self.hwm, zero=True)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """The shared-secret token of TCP and mutating REST calls.

    Attributes:
        token: the token itself (prefer token_file: the environment and files leak more easily).
        token_file: file holding the token; default ``<data_dir>/token``, generated (0600) when
            missing.
    """

    token: str | None = None
    token_file: str | None = None

    def __repr__(self) -> str:  # the token never reaches a log line
        return f"AuthConfig(token={'<set>' if self.token else None}, token_file={self.token_file!r})"

    def __post_init__(self) -> None:
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < MIN_TOKEN_LEN):
            raise ConfigError(f"auth.token must be text of at least {MIN_TOKEN_LEN} characters")
        if self.token_file is not None and not typed("auth.token_file", self.token_file, str):
            raise ConfigError("auth.token_file must be a path")


REMOTE_WRITE_MODES = ("through", "back", "read-only")


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The remote tier (issue 23): block records shared by many hosts through a Redis/Valkey Cluster.

    Attributes:
        url: seed nodes, ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (``rediss+cluster://`` for
            TLS); None: no remote tier.
        user: ACL user (None: the default user). With tenants, give it ``~<key_prefix>:<tenant>:*``.
        password_file: file whose first line is the password (never logged; None: no password).
        tls_ca_file: CA bundle that signs the servers' certificates (TLS; None: the system's CAs).
        write_mode: ``through`` (upload every committed block, in the background), ``back``
            (upload host blocks when they are evicted) or ``read-only`` (never upload).
        upload_queue_bytes: payload bytes waiting for upload at most; an upload beyond it is
            dropped and counted (a save never waits on the network).
        timeout_s: deadline of one call to the cluster (a fetch, an upload batch).
        lookup_budget_ms: what a lookup may spend asking the cluster for the rest of a prefix;
            then it answers with what it knows.
        key_prefix: first part of every key: ``<key_prefix>:<tenant>:...``.
        codec: the codec of the records this daemon uploads (issue 25; TOML also
            ``[tiers.remote] codec``). ``"raw"`` (default) uploads every record as it is. A
            quantizing codec (``"int8"``, ...) re-encodes, on the I/O pool, each uploaded record
            whose header says raw (uncompressed) float16/bfloat16/float32 KV; the cluster's copy
            then says that codec, and a request with ``accept_lossy`` false never gets it. Other
            records go up as they are. The host copy is untouched.
        compression: ``"lz4"``: byte-shuffle and LZ4 each section of a re-encoded record (SPEC.md
            §4.8; lossless); ``"none"`` (default). Applies only to the records ``codec`` re-encodes
            (TOML also ``[tiers.remote] compression``).
        k_axis: what one K scale covers in the MHA records ``codec`` (or a ``models`` codec)
            re-encodes with int8/int4/int2: ``"channel"`` (default) or ``"token"`` (TOML also
            ``[tiers.remote] k_axis``); as ``StoreConfig.disk_k_axis`` (fp8 and MLA ignore it).
        models: per-model exceptions to ``codec`` (TOML also ``[tiers.remote.models]``):
            ``(pattern, codec)`` pairs, the first pattern matching a block's namespace model
            deciding; as ``StoreConfig.disk_models``.
    """

    url: str | None = None
    user: str | None = None
    password_file: str | None = None
    tls_ca_file: str | None = None
    write_mode: str = "through"
    upload_queue_bytes: int = 256 * MIB
    timeout_s: float = 1.0
    lookup_budget_ms: float = 10.0
    key_prefix: str = "kvtier"
    codec: str = "raw"
    compression: str = "none"
    k_axis: str = "channel"
    models: CodecModels = ()

    def __repr__(self) -> str:  # the password stays in its file; its path alone is shown
        return (f"RemoteConfig(url={self.url!r}, user={self.user!r}, password_file={self.password_file!r}, "
                f"write_mode={self.write_mode!r})")

    def __post_init__(self) -> None:
        if self.url is not None:
            try:
                parse_cluster_url(typed("remote.url", self.url, str))
            except ValueError as e:
                raise ConfigError(f"remote.url: {e}") from None
        for name in ("user", "password_file", "tls_ca_file"):
            value = getattr(self, name)
            if value is not None and not typed(f"remote.{name}", value, str):
                raise ConfigError(f"remote.{name} must not be empty")
        if typed("remote.write_mode", self.write_mode, str) not in REMOTE_WRITE_MODES:
            raise ConfigError(f"remote.write_mode must be one of {REMOTE_WRITE_MODES}, got {self.write_mode!r}")
        positive("remote.upload_queue_bytes", self.upload_queue_bytes, zero=True)
        positive("remote.timeout_s", self.timeout_s, number=True)
        positive("remote.lookup_budget_ms", self.lookup_budget_ms, number=True)
        if not PREFIX.fullmatch(typed("remote.key_prefix", self.key_prefix, str)):
            raise ConfigError(f"remote.key_prefix must match {PREFIX.pattern}, got {self.key_prefix!r:.80}")
        if typed("remote.codec", self.codec, str) not in CODECS:
            raise ConfigError(f"remote.codec must be one of {CODECS}, got {self.codec!r:.80}")
        if typed("remote.compression", self.compression, str) not in TIER_COMPRESSIONS:
            raise ConfigError(f"remote.compression must be one of {TIER_COMPRESSIONS}, got {self.compression!r:.80}")
        if typed("remote.k_axis", self.k_axis, str) not in K_AXES:
            raise ConfigError(f"remote.k_axis must be one of {K_AXES}, got {self.k_axis!r:.80}")
        try:
            object.__setattr__(self, "models", check_codec_models("remote.models", self.models))
        except StoreConfigError as e:
            raise ConfigError(e.message) from None

    @property
    def enabled(self) -> bool:
        """Whether a remote tier is configured."""
        return self.url is not None
