"""``kvtier serve``: run the daemon (kvtierd) in the foreground.

Flags override the ``KVTIER_*`` environment, which overrides the TOML file (``--config``), which
overrides the embedded defaults (:mod:`kvtier.daemon.config`). Also runnable as
``python -m kvtier.commands.serve [flags]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
    ("--token-file", "auth.token_file", "FILE", "file holding the token (default: DIR/token, generated 0600)"),
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
                    "SIGTERM or SIGINT drains and stops it (a second SIGINT stops it at once).")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="TOML settings (configs/kvtier.toml documents every option; default: $KVTIER_CONFIG)")
    for flag, option, metavar, help_text in FLAGS:
        p.add_argument(flag, metavar=metavar, default=None, dest=option, help=help_text)
    p.set_defaults(func=run)
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, object]:
    """The options the flags set, as ``{"section.key": text}`` for :func:`kvtier.daemon.config.load_config`."""
    return {option: getattr(args, option) for _, option, _, _ in FLAGS if getattr(args, option) is not None}


def run(args: argparse.Namespace) -> int:
    """Load the settings, set up logging, run the daemon until a signal; returns the exit status."""
    import asyncio
    import logging
    import os

    from kvtier.daemon.config import ConfigError, load_config

    try:
        config = load_config(args.config, overrides=overrides_from(args))
    except ConfigError as e:
        print(f"kvtier serve: {e}", file=sys.stderr)
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
