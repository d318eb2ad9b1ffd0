"""``kvtier serve``: run the daemon (kvtierd) in the foreground.

Flags override the ``KVTIER_*`` environment, which overrides the TOML file (``--config``), which
overrides the embedded defaults (:mod:`kvtier.daemon.config`). Also runnable as
``python -m kvtier.commands.serve [flags]``.

The token (:data:`TOKEN_RULE`): ``KVTIER_TOKEN`` / ``auth.token`` hold the token itself;
``--token-file`` / ``KVTIER_TOKEN_FILE`` / ``auth.token_file`` name a file holding it. The token
itself wins over a file, except ``--token-file``, which wins over both. A ``KVTIER_TOKEN`` whose
value names an existing file is refused (the mistake of setting it to a path).

The host tier must fit the memory that backs it (:func:`host_backing`): physical RAM, and the
free space of /dev/shm (plus the segments a dead daemon left there, which the store reclaims or
adopts). A larger ``--host-bytes`` is refused with one line (exit 2) unless ``--force-host-bytes``.

Exit status: 0 after a clean stop; 2 for a configuration error (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

TOKEN_RULE = ("KVTIER_TOKEN (or auth.token) holds the token itself, at least 16 characters; KVTIER_TOKEN_FILE "
              "(or auth.token_file, --token-file) names a file holding it. The token itself wins over a file, "
              "except --token-file, which wins over both.")

FLAGS: tuple[tuple[str, str, str, str], ...] = (
    # flag, option, metavar, help
    ("--data-dir", "daemon.data_dir", "DIR", "directory of the disk tier and the token file "
     "(default: $XDG_CACHE_HOME/kvtier, else ~/.cache/kvtier)"),
    ("--host-bytes", "store.host_bytes", "SIZE", "shared host-memory tier, e.g. 4GiB "
     "(default: min(4 GiB, 25%% of RAM))"),
    ("--disk-bytes", "store.disk_bytes", "SIZE", "disk tier budget, e.g. 20GiB; 0 = no disk tier (default: 20GiB)"),
    ("--gpu-bytes", "store.gpu_bytes", "SIZE", "GPU tier, used where CUDA is available (default: 0, off)"),
    ("--socket", "dataplane.socket", "PATH", "unix socket of the data plane, or 'off' (default: "
     "$XDG_RUNTIME_DIR/kvtier/kvtier.sock, else /run/kvtier/kvtier.sock or DIR/kvtier.sock)"),
    ("--listen", "dataplane.listen", "HOST:PORT", "TCP data plane (token required), or 'off' (default: off)"),
    ("--rest", "rest.listen", "HOST:PORT", "REST API and /metrics, or 'off' (default: 127.0.0.1:7471)"),
    ("--events", "events.endpoint", "ENDPOINT", "ZMQ PUB endpoint of KV events, e.g. tcp://127.0.0.1:5557 "
     "(default: off)"),
    ("--replay", "events.replay_endpoint", "ENDPOINT", "ZMQ ROUTER endpoint answering event replay requests "
     "(default: off)"),
    ("--topic", "events.topic", "TOPIC", "KV-event topic kv@<pod>@<model> (default: kv@<hostname>@kvtier)"),
    ("--token-file", "auth.token_file", "FILE", "file holding the token; wins over $KVTIER_TOKEN (default: "
     "$KVTIER_TOKEN_FILE, else DIR/token, generated 0600; $KVTIER_TOKEN holds the token itself, not a file)"),
    ("--log-level", "daemon.log_level", "LEVEL", "debug, info, warning, error or critical (default: info)"),
    ("--remote", "remote.url", "URL", "remote tier shared by many hosts: redis+cluster://HOST:PORT[,HOST:PORT...] "
     "(rediss+cluster:// for TLS; default: off)"),
)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``kvtier`` command line."""
    p = subparsers.add_parser(
        "serve", help="run the kvtier daemon (kvtierd) in the foreground",
        description="Run kvtierd: the tiered KV-cache store with its data plane, REST API, metrics and KV "
                    "events. Precedence: flags > KVTIER_* environment > --config file > defaults. "
                    "SIGTERM or SIGINT drains and stops it (a second SIGINT stops it at once).",
        epilog="Token: " + TOKEN_RULE.replace("%", "%%"))
    p.add_argument("--config", metavar="FILE", default=None,
                   help="TOML settings (configs/kvtier.toml documents every option; default: $KVTIER_CONFIG)")
    for flag, option, metavar, help_text in FLAGS:
        p.add_argument(flag, metavar=metavar, default=None, dest=option, help=help_text)
    p.add_argument("--force-host-bytes", action="store_true",
                   help="start even when --host-bytes exceeds the memory that can back it (RAM, free /dev/shm); "
                        "writes may then fail (SIGBUS) once it fills")
    p.set_defaults(func=run)
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, object]:
    """The options the flags set, as ``{"section.key": text}`` for :func:`kvtier.daemon.config.load_config`.

    ``--token-file`` also unsets ``auth.token``: the file named on the command line wins (:data:`TOKEN_RULE`)."""
    out: dict[str, object] = {option: getattr(args, option) for _, option, _, _ in FLAGS
                              if getattr(args, option) is not None}
    if "auth.token_file" in out:
        out["auth.token"] = "off"
    return out


def token_value_problem(token: str | None, source: str) -> str | None:
    """Why ``token`` (from ``source``) is surely not a token but a file's path (None: no such sign)."""
    if token and os.path.isfile(os.path.expanduser(token)):
        return (f"{source} holds the token itself, but its value names the file {token}; "
                f"set KVTIER_TOKEN_FILE={token} (or pass --token-file) instead")
    return None


@dataclass(frozen=True, slots=True)
class HostBacking:
    """What can back a host tier of shared memory, in bytes."""

    ram: int  # physical memory
    shm_free: int  # free space of /dev/shm (RAM where it cannot be read)
    reclaimable: int  # segments of dead daemons with this prefix in /dev/shm, freed or adopted at start

    @property
    def limit(self) -> int:
        return min(self.ram, self.shm_free + self.reclaimable)


def host_backing(name_prefix: str, shm_dir: str = "/dev/shm") -> HostBacking:
    """Physical RAM, free /dev/shm space, and the bytes held there by segments (and journals) of
    this prefix whose daemon is gone (``<prefix>-<pid>-<hex>``): the store reclaims or adopts them."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        st = os.statvfs(shm_dir)
        names = os.listdir(shm_dir)
    except OSError:
        return HostBacking(ram, ram, 0)
    pattern = re.compile(re.escape(name_prefix) + r"-(\d+)-[0-9a-f]+(\.journal(\.tmp)?)?")
    reclaimable = 0
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            reclaimable += os.stat(os.path.join(shm_dir, name)).st_blocks * 512
        except OSError:
            continue
    return HostBacking(ram, st.f_bavail * st.f_frsize, reclaimable)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or not a pid): not ours to count
    return True


def host_bytes_problem(host_bytes: int, backing: HostBacking) -> str | None:
    """The one line refusing a host tier larger than what can back it (None: it fits)."""
    if host_bytes <= backing.limit:
        return None
    shm = f"{_size(backing.shm_free)} free in /dev/shm" + (
        f" + {_size(backing.reclaimable)} of a dead daemon's segments" if backing.reclaimable else "")
    return (f"host tier {_size(host_bytes)} is larger than the memory that can back it ({_size(backing.ram)} RAM, "
            f"{shm}); lower --host-bytes (store.host_bytes), or pass --force-host-bytes to start anyway")


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    """Load the settings, set up logging, run the daemon until a signal; returns the exit status."""
    import asyncio
    import logging

    from kvtier.daemon.config import ConfigError, load_config

    try:
        config = load_config(args.config, overrides=overrides_from(args))
    except ConfigError as e:
        print(f"kvtier serve: {e}", file=sys.stderr)
        return 2
    problem = token_value_problem(config.auth.token, "KVTIER_TOKEN (auth.token)")
    if problem is None and not getattr(args, "force_host_bytes", False):
        problem = host_bytes_problem(config.store.host_bytes, host_backing(config.store.host_name_prefix))
    if problem is not None:
        print(f"kvtier serve: {problem}", file=sys.stderr)
        return 2
    # Under systemd the journal stamps each line already ($JOURNAL_STREAM is set for its stderr).
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format=stamp + "%(levelname)s %(name)s: %(message)s")
    from kvtier.daemon.server.daemon import run_daemon
    from kvtier.daemon.store.owner import private_umask

    private_umask()  # RocksDB's files too are made 0600, whatever the umask kvtier serve inherits
    try:
        import uvloop  # optional: a faster event loop where installed
    except ImportError:
        factory = None
    else:
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run_daemon(config))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvtier.commands.serve [flags]``: the same as ``kvtier serve [flags]``."""
    parser = argparse.ArgumentParser(prog="kvtier")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
