"""``kvtier status|ls|inspect|lookup|clear|check``: the daemon's REST API from the command line.

Every command talks to a running daemon over REST (``--rest``, else ``$KVTIER_REST``, else the
configuration's ``rest.listen``, else ``http://127.0.0.1:7471``) with the standard library only.
Output is a human-readable table, or the daemon's JSON with ``--json``. Mutations (clear,
check) send the daemon's token: the file ``--token-file`` names, else the token itself
(``KVTIER_TOKEN``, ``auth.token``), else a token file (``KVTIER_TOKEN_FILE``, ``auth.token_file``,
``<data_dir>/token``): the rule of :data:`kvtier.commands.serve.TOKEN_RULE`. ``--tenant NAME``
works on a tenant's store instead of the default one: with the admin token, or with that
tenant's own token (``--token-file``); every command then sends the token.

``kvtier check --data-dir D`` works offline instead: no daemon, no token; it opens the disk
tiers under ``D`` directly (``D/disk``, each tenant's, or ``D`` itself if it is a tier's directory)
as a daemon's start would (damaged metadata is rebuilt from the block files, and reported), lists
the block files the metadata does not list, and verifies every record
(:mod:`kvtier.daemon.store.disk_check`). It is refused while a daemon holds the tier.

Exit status (one line on stderr, no traceback, for 1 and 2): 0 done; 1 the daemon is unreachable
or failing, or ``check`` found problems it did not repair; 2 a user error (an option, file, token
or hash to fix, a request the daemon refused as invalid), as argparse's 2 for bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

# Light: json and os; urllib is imported when a request is made.
from kvtier.commands.rest_client import FAILED, USER_ERROR, CommandError, RestClient

DEFAULT_REST = "http://127.0.0.1:7471"
DEFAULT_LS_LIMIT = 50


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the admin subcommands to the ``kvtier`` parser."""
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("daemon")
    g.add_argument("--rest", metavar="URL", default=None,
                   help=f"REST address, http://HOST:PORT or HOST:PORT (default: $KVTIER_REST, the "
                        f"configuration's rest.listen, else {DEFAULT_REST})")
    g.add_argument("--config", metavar="FILE", default=None, help="daemon configuration (TOML) to read defaults from")
    g.add_argument("--timeout", metavar="S", type=float, default=10.0, help="seconds to wait for the daemon (10)")
    g.add_argument("--json", action="store_true", help="print the daemon's JSON answer instead of a table")
    g.add_argument("--tenant", metavar="NAME", default=None,
                   help="work on this tenant's store (needs the admin token or the tenant's own --token-file)")
    g.add_argument("--token-file", metavar="FILE", default=None,
                   help="file holding the daemon's (or a tenant's) token; without it: the token itself from "
                        "$KVTIER_TOKEN (or auth.token), else the file $KVTIER_TOKEN_FILE (or auth.token_file), "
                        "else <data_dir>/token")

    def add(name: str, func: Callable[[RestClient, argparse.Namespace], int], text: str,
            needs_token: bool = False) -> argparse.ArgumentParser:
        p = subparsers.add_parser(name, parents=[common], help=text, description=text)
        p.set_defaults(func=lambda args: _run(func, args), needs_token=needs_token)
        return p

    add("status", _status, "show the daemon's version, readiness, tiers and counters")
    p = add("ls", _ls, "list namespaces, or blocks with --ns / --tier / --blocks")
    p.add_argument("--ns", metavar="HEX", default=None, help="list the blocks of this namespace id")
    p.add_argument("--tier", choices=("gpu", "host", "disk"), default=None, help="only blocks with a copy here")
    p.add_argument("--blocks", action="store_true", help="list blocks of every namespace")
    p.add_argument("--limit", metavar="N", type=int, default=DEFAULT_LS_LIMIT,
                   help=f"at most N blocks ({DEFAULT_LS_LIMIT})")
    p.add_argument("--all", action="store_true", help="every block (overrides --limit)")
    p = add("inspect", _inspect, "show one block: decoded header, tiers, size, hits, age")
    p.add_argument("ns", metavar="NS", help="namespace id (32 hex digits)")
    p.add_argument("hash", metavar="HASH", help="chain hash (hex), or a unique prefix of at least 4 digits "
                                                "(e.g. the 16 `kvtier ls` shows); an ambiguous one names a few matches")
    p = add("lookup", _lookup, "how many tokens of a prompt are stored, per tier")
    p.add_argument("--ns", metavar="HEX", required=True, help="namespace id (registered with the daemon)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", metavar="IDS", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--tokens-file", metavar="FILE",
                     help="token ids in a file: a JSON array, or integers separated by commas or spaces")
    p = add("clear", _clear, "remove every block of a namespace (needs the token)", True)
    p.add_argument("--ns", metavar="HEX", required=True, help="namespace id (32 hex digits)")
    p = add("check", _check, "audit the index against the stored blocks (needs the token); exit 1 when "
                             "problems remain", True)
    p.add_argument("--fix", action="store_true", help="repair what the audit finds")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help="check the disk tiers under DIR directly, with no daemon running (offline)")
    p.set_defaults(func=lambda args: _check_offline(args) if args.data_dir is not None else _run(_check, args))


def _run(func: Callable[[RestClient, argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return func(RestClient.from_args(args), args)
    except CommandError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return exc.status


# --- commands --------------------------------------------------------------------------------------


def _status(rest: RestClient, args: argparse.Namespace) -> int:
    health = rest.get("/v1/health")
    ready = rest.get("/v1/ready", ok_statuses=(503,)).get("ready", False)
    stats = rest.get("/v1/stats")
    tiers = rest.get("/v1/tiers")["tiers"]
    if args.json:
        return _print_json({"health": health, "ready": ready, "stats": stats, "tiers": tiers})
    c, g = stats["counters"], stats["gauges"]
    print(f"kvtier {health['version']} at {rest.base}: {'ready' if ready else 'NOT READY'}, "
          f"up {_duration(health['uptime_s'])}")
    # The remote tier's size and contents are the cluster's own: None there, shown as "-".
    rows = [[t["tier"], "on" if t["enabled"] else "off", _size_or_dash(t["used_bytes"]),
             _size_or_dash(t["capacity_bytes"]),
             f"{100 * t['used_bytes'] / t['capacity_bytes']:.0f}%" if t["capacity_bytes"] else "-",
             "-" if t["blocks"] is None else t["blocks"], t["hits"], t["evictions"], t["demotions"]] for t in tiers]
    print(_table(["TIER", "STATE", "USED", "CAPACITY", "USE", "BLOCKS", "HITS", "EVICTIONS", "DEMOTIONS"], rows))
    print(f"blocks {g['blocks']} (pending {g['pending']}), leases {g['leases']}, "
          f"host fragmentation {100 * g['fragmentation']:.1f}%")
    print(f"lookups {c['lookups']}: {c['lookup_hits']} of {c['lookup_keys']} keys hit; commits {c['commits']}, "
          f"promotions {c['promotions']}, demotions {c['demotions']}, deletes {c['deletes']}; "
          f"checksum failures {c['checksum_failures']}, storage errors {c['storage_errors']}, "
          f"lease expiries {c['lease_expiries']}")
    remote = stats.get("remote")
    if remote:
        print(f"remote {remote['address']} (keys of tenant {remote['tenant']}, write {remote['write_mode']}): "
              f"breaker {remote['breaker_state']}; up {remote['blocks_up']} blocks / {_size(remote['bytes_up'])}, "
              f"down {remote['blocks_down']} blocks / {_size(remote['bytes_down'])}; "
              f"queue {remote['queue_blocks']} blocks / {_size(remote['queue_bytes'])}, drops {remote['upload_drops']}; "
              f"bad values {sum(remote['bad_values'].values())}; "
              f"errors {', '.join(f'{k} {v}' for k, v in sorted(remote['errors'].items())) or 'none'}")
    return 0


def _ls(rest: RestClient, args: argparse.Namespace) -> int:
    if args.ns is None and args.tier is None and not args.blocks:
        spaces = rest.get("/v1/namespaces")["namespaces"]
        if args.json:
            return _print_json({"namespaces": spaces})
        if not spaces:
            print("no namespaces: the daemon holds no blocks and none is registered")
            return 0
        rows = []
        for n in spaces:
            f = n.get("fields", {})  # only registered namespaces have fields
            rows.append([n["ns_id"], f.get("model", "-"), f.get("revision", "-"), f.get("block_tokens", "-"),
                         "yes" if n["registered"] else "no", n["blocks"]])
        print(_table(["NAMESPACE", "MODEL", "REVISION", "BLOCK_TOKENS", "REGISTERED", "BLOCKS"], rows))
        return 0
    if args.limit < 1 and not args.all:
        raise CommandError("--limit must be at least 1")
    blocks, more = _walk_blocks(rest, args)
    if args.json:
        return _print_json({"blocks": blocks, "truncated": more})
    if not blocks:
        print("no blocks")
        return 0
    rows = [[b["ns"], b["hash"][:16], ",".join(b["tiers"]), _size(b["size"]), b["num_tokens"], b["hits"],
             b["priority"], f"{b['idle_s']:.0f}s"] for b in blocks]
    print(_table(["NAMESPACE", "HASH", "TIERS", "SIZE", "TOKENS", "HITS", "PRIORITY", "IDLE"], rows))
    if more:
        print(f"(first {len(blocks)} blocks; --limit N or --all for more)")
    return 0


def _walk_blocks(rest: RestClient, args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    """Follow the cursor until ``--limit`` blocks (or all of them with ``--all``)."""
    from urllib.parse import urlencode

    blocks: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        want = 1000 if args.all else min(1000, args.limit - len(blocks))
        query = {k: v for k, v in (("ns", args.ns), ("tier", args.tier), ("cursor", cursor)) if v is not None}
        page = rest.get("/v1/blocks?" + urlencode({**query, "limit": want}))
        blocks.extend(page["blocks"])
        cursor = page["next_cursor"]
        if cursor is None:
            return blocks, False
        if not args.all and len(blocks) >= args.limit:
            return blocks, True


def _inspect(rest: RestClient, args: argparse.Namespace) -> int:
    from urllib.parse import quote

    info = rest.get(f"/v1/blocks/{quote(args.ns, safe='')}/{quote(args.hash, safe='')}")
    if args.json:
        return _print_json(info)
    header = info.pop("header", None) or {}
    rows = [[k, _text(v)] for k, v in info.items()]
    rows += [[f"header.{k}", _text(v)] for k, v in header.items()]
    print(_table(["FIELD", "VALUE"], rows))
    return 0


def _lookup(rest: RestClient, args: argparse.Namespace) -> int:
    tokens = _read_tokens(args)
    found = rest.post("/v1/lookup", {"ns": args.ns, "token_ids": tokens})
    if args.json:
        return _print_json(found)
    per_tier = ", ".join(f"{tier} {n}" for tier, n in sorted(found["per_tier"].items())) or "none"
    print(f"hit {found['hit_tokens']} of {found['num_tokens']} tokens ({found['hit_blocks']} of "
          f"{found['num_blocks']} blocks of {found['block_tokens']}); by tier: {per_tier}")
    return 0


def _read_tokens(args: argparse.Namespace) -> list[int]:
    import json

    text = args.tokens
    if args.tokens_file is not None:
        try:
            with open(args.tokens_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {args.tokens_file}: {exc}") from None
        if text.lstrip().startswith("["):
            try:
                tokens = json.loads(text)
            except ValueError as exc:
                raise CommandError(f"{args.tokens_file} is not a JSON array of token ids: {exc}") from None
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise CommandError(f"{args.tokens_file} must hold an array of integers")
            return tokens
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise CommandError("token ids must be integers separated by commas or spaces") from None


def _clear(rest: RestClient, args: argparse.Namespace) -> int:
    out = rest.post("/v1/clear", {"ns": args.ns}, token=True)
    if args.json:
        return _print_json(out)
    print(f"cleared {out['cleared']} blocks of namespace {args.ns}")
    return 0


def _check(rest: RestClient, args: argparse.Namespace) -> int:
    report = rest.post("/v1/check", {"fix": args.fix}, token=True, timeout=max(args.timeout, 600.0))
    if args.json:
        _print_json(report)
    else:
        counts = ", ".join(f"{k} {v}" for k, v in report["counts"].items())
        verdict = "no problems found" if report["ok"] else ("problems repaired" if report["fixed"]
                                                            else "problems found; run `kvtier check --fix`")
        print(f"{verdict} ({counts})")
        for name in ("missing", "orphans", "corrupt", "adopted"):
            for key in report[name]:
                print(f"  {name}: {key['ns']}/{key['hash']}" + (f" ({key['tier']})" if "tier" in key else ""))
        for line in report["accounting"]:
            print(f"  accounting: {line}")
        for line in report.get("notes", []):
            print(f"  note: {line}")
    return 0 if report["ok"] or report["fixed"] else FAILED


def _check_offline(args: argparse.Namespace) -> int:
    """``check --data-dir D``: the disk tiers under D, read directly (see the module docstring)."""
    import dataclasses
    import os

    from kvtier.daemon.store.disk_check import check_tier, tier_paths
    from kvtier_protocol.errors import KVTierError

    data_dir = os.path.abspath(os.path.expanduser(args.data_dir))
    paths = tier_paths(data_dir)
    if not paths:
        print(f"kvtier: no disk tier under {data_dir}", file=sys.stderr)
        return USER_ERROR
    try:
        reports = [check_tier(p, fix=args.fix) for p in paths]
    except KVTierError as exc:  # e.g. a daemon holds the tier: the check could not run
        print(f"kvtier: {exc}", file=sys.stderr)
        return FAILED
    if args.json:
        _print_json({"tiers": [{**dataclasses.asdict(r), "ok": r.ok} for r in reports]})
    for r in reports if not args.json else ():
        verdict = "no problems found" if r.ok else ("problems repaired" if r.fixed or not (r.missing or r.corrupt
                                                                                           or r.unlisted)
                                                    else "problems found; run `kvtier check --fix --data-dir`")
        print(f"disk tier {r.path}: {verdict} ({r.records} records, missing {len(r.missing)}, corrupt "
              f"{len(r.corrupt)}, unlisted {len(r.unlisted)}, adopted {len(r.adopted)}, free files {r.free_files} "
              f"({_size(r.free_bytes)}))")
        if r.repair is not None:
            print(f"  repaired at open: {r.repair}")
        for name in ("missing", "corrupt", "unlisted", "adopted"):
            for key in getattr(r, name)[:100]:
                print(f"  {name}: {key}")
    done = all(r.ok or r.fixed or not (r.missing or r.corrupt or r.unlisted) for r in reports)
    return 0 if done else FAILED


# --- formatting --------------------------------------------------------------------------------------


def _print_json(obj: Any) -> int:
    import json

    print(json.dumps(obj, indent=2))
    return 0


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[_text(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        import json

        return json.dumps(value)
    return str(value)


def _size_or_dash(n: int | None) -> str:
    return "-" if n is None else _size(n)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable: the loop returns at TiB")


def _duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return " ".join(f"{v}{u}" for v, u in ((d, "d"), (h, "h"), (m, "m"), (s, "s")) if v) or "0s"
