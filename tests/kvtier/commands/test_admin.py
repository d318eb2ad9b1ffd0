"""Admin commands against an in-process REST server on 127.0.0.1:0 (commands run in a thread)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from kvtier import cli
from kvtier.commands.admin import register
from kvtier.daemon.server.rest import create_rest_app
from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.types import make_key
from tests.kvtier.commands.envkit import isolate_env
from tests.kvtier.daemon.server.restkit import NS, NS_HEX, TOKEN, open_ctx, put_tokens, tokens_for
from tests.kvtier.daemon.store.storekit import make_rec
from tests.kvtier.daemon.store.test_disk_repair import damage

COMMANDS = ("status", "ls", "inspect", "lookup", "clear", "check")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    isolate_env(monkeypatch, tmp_path)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


async def kvtier(*argv: str) -> int:
    """Run one admin command in a worker thread (it blocks on HTTP; the server runs on this loop)."""
    args = parse(list(argv))
    return await asyncio.to_thread(args.func, args)


@asynccontextmanager
async def daemon(tmp_path, **kwargs: object) -> AsyncIterator[tuple[object, str]]:
    """A store, its context and the REST app served on 127.0.0.1 at a free port: (ctx, url)."""
    async with open_ctx(tmp_path, **kwargs) as ctx:
        runner = web.AppRunner(create_rest_app(ctx))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        try:
            yield ctx, f"http://{host}:{port}"
        finally:
            await runner.cleanup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_everywhere(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as exc:
            parse([name, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: kvtier {name}") and "--rest" in out and "--json" in out


async def test_status(tmp_path, capsys):
    async with daemon(tmp_path) as (ctx, url):
        await put_tokens(ctx.store, tokens_for(12))
        assert await kvtier("status", "--rest", url) == 0
        out = capsys.readouterr().out
        assert "ready" in out.splitlines()[0] and ctx.version in out
        rows = {line.split()[0]: line.split() for line in out.splitlines()[1:5]}
        assert rows["TIER"][:3] == ["TIER", "STATE", "USED"] and rows["gpu"][1] == "off"
        assert rows["host"][1] == "on" and rows["host"][-4] == "8" and rows["disk"][-4] == "4"
        assert "blocks 12" in out and "demotions 4" in out
        ctx.ready = False
        assert await kvtier("status", "--rest", url.removeprefix("http://"), "--json") == 0
        status = json.loads(capsys.readouterr().out)
        assert status["ready"] is False and status["stats"]["counters"]["commits"] == 12


async def test_ls_namespaces_and_blocks(tmp_path, capsys):
    async with daemon(tmp_path) as (ctx, url):
        keys = await put_tokens(ctx.store, tokens_for(12))
        assert await kvtier("ls", "--rest", url) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == ["NAMESPACE", "MODEL", "REVISION", "BLOCK_TOKENS", "REGISTERED", "BLOCKS"]
        assert lines[1].split() == [NS_HEX, "test/model", "r1", "16", "yes", "12"]
        assert await kvtier("ls", "--rest", url, "--ns", NS_HEX, "--limit", "5") == 0
        out = capsys.readouterr().out.splitlines()
        assert len(out) == 1 + 5 + 1 and "--all" in out[-1]
        assert [line.split()[1] for line in out[1:6]] == sorted(k.hex()[:16] for k in keys)[:5]
        assert await kvtier("ls", "--rest", url, "--tier", "disk", "--all", "--json") == 0
        listed = json.loads(capsys.readouterr().out)
        assert len(listed["blocks"]) == 4 and not listed["truncated"]
        assert all(b["tiers"] == ["disk"] for b in listed["blocks"])
        assert await kvtier("ls", "--rest", url, "--blocks", "--all") == 0
        assert len(capsys.readouterr().out.splitlines()) == 1 + 12
        assert await kvtier("ls", "--rest", url, "--tier", "gpu") == 0
        assert capsys.readouterr().out == "no blocks\n"


async def test_inspect(tmp_path, capsys):
    async with daemon(tmp_path) as (ctx, url):
        keys = await put_tokens(ctx.store, tokens_for(2))
        assert await kvtier("inspect", "--rest", url, NS_HEX, keys[1].hex()) == 0
        fields = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines()[1:])
        assert fields["hash"] == keys[1].hex() and fields["parent"] == keys[0].hex()
        assert fields["tiers"] == '["host"]' and fields["header.layout"] == "canonical"
        assert fields["header.shape"] == "[1, 2, 1, 16, 64]"
        assert await kvtier("inspect", "--rest", url, NS_HEX, "ab/../cd") == 2  # quoted: stays one path part
        err = capsys.readouterr().err
        assert err.startswith("kvtier: invalid_key:") and err.count("\n") == 1
        assert await kvtier("inspect", "--rest", url, NS_HEX, "ab" * 32) == 2
        assert capsys.readouterr().err.startswith("kvtier: not_found:")


async def test_lookup(tmp_path, capsys):
    async with daemon(tmp_path) as (ctx, url):
        tokens = tokens_for(12)
        await put_tokens(ctx.store, tokens)
        assert await kvtier("lookup", "--rest", url, "--ns", NS_HEX, "--tokens", ",".join(map(str, tokens[:40]))) == 0
        assert capsys.readouterr().out.strip() == "hit 32 of 40 tokens (2 of 2 blocks of 16); by tier: disk 32"
        as_json, as_text = tmp_path / "t.json", tmp_path / "t.txt"
        as_json.write_text(json.dumps(tokens))
        as_text.write_text(" ".join(map(str, tokens[:100])) + "\n")
        assert await kvtier("lookup", "--rest", url, "--ns", NS_HEX, "--tokens-file", str(as_json), "--json") == 0
        found = json.loads(capsys.readouterr().out)
        assert found["hit_tokens"] == 192 and found["per_tier"] == {"disk": 64, "host": 128}
        assert await kvtier("lookup", "--rest", url, "--ns", NS_HEX, "--tokens-file", str(as_text)) == 0
        assert capsys.readouterr().out.startswith("hit 96 of 100 tokens")
        assert await kvtier("lookup", "--rest", url, "--ns", "00" * 16, "--tokens", "1,2") == 2
        assert capsys.readouterr().err.startswith("kvtier: not_found: namespace")
        assert await kvtier("lookup", "--rest", url, "--ns", NS_HEX, "--tokens", "1,x") == 2
        assert "integers" in capsys.readouterr().err


async def test_clear_needs_the_token(tmp_path, capsys, monkeypatch):
    async with daemon(tmp_path) as (ctx, url):
        await put_tokens(ctx.store, tokens_for(3))
        assert await kvtier("clear", "--rest", url, "--ns", NS_HEX) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvtier: unauthorized:") and "--token-file" in err and TOKEN not in err
        token_file = tmp_path / "my-token"
        token_file.write_text(TOKEN + "\n")
        assert await kvtier("clear", "--rest", url, "--ns", NS_HEX, "--token-file", str(token_file)) == 0
        assert capsys.readouterr().out.strip() == f"cleared 3 blocks of namespace {NS_HEX}"
        monkeypatch.setenv("KVTIER_TOKEN", TOKEN)
        monkeypatch.setenv("KVTIER_REST", url.removeprefix("http://"))
        assert await kvtier("clear", "--ns", NS_HEX, "--json") == 0
        assert json.loads(capsys.readouterr().out) == {"cleared": 0}


async def test_token_from_the_default_token_file(tmp_path, capsys):
    async with daemon(tmp_path) as (ctx, url):
        data_dir = tmp_path / "cache" / "kvtier"  # load_config's default data_dir under XDG_CACHE_HOME
        data_dir.mkdir(parents=True)
        fd = os.open(data_dir / "token", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, TOKEN.encode())
        os.close(fd)
        assert await kvtier("check", "--rest", url) == 0
        assert capsys.readouterr().out.startswith("no problems found")


async def test_check(tmp_path, capsys):
    async with daemon(tmp_path) as (ctx, url):
        token_file = tmp_path / "tok"
        token_file.write_text(TOKEN)
        keys = await put_tokens(ctx.store, tokens_for(12))
        assert await kvtier("check", "--rest", url, "--token-file", str(token_file)) == 0
        assert capsys.readouterr().out.startswith("no problems found (missing 0,")
        ctx.store.disk.delete_many([NS.ns_id + keys[0]])  # a disk-only block loses its record
        assert await kvtier("check", "--rest", url, "--token-file", str(token_file)) == 1
        out = capsys.readouterr().out
        assert "kvtier check --fix" in out and f"missing: {NS_HEX}/{keys[0].hex()}" in out
        assert await kvtier("check", "--rest", url, "--token-file", str(token_file), "--fix", "--json") == 0
        assert json.loads(capsys.readouterr().out)["fixed"] is True


async def test_check_finds_block_files_the_metadata_does_not_list(tmp_path, capsys):
    """A block's entry is lost while a whole file of it remains that no entry lists: check reports
    it (an orphan), and ``--fix`` lists it again and serves it from disk."""
    async with daemon(tmp_path) as (ctx, url):
        token_file = tmp_path / "tok"
        token_file.write_text(TOKEN)
        keys = await put_tokens(ctx.store, tokens_for(12))
        disk, key = ctx.store.disk, NS.ns_id + keys[0]
        src = Path(disk.file_path(key))
        fid = 0x7777
        shutil.copyfile(src, src.parent.parent / f"{fid & 0xFF:02x}" / f"{fid:016x}")
        disk.delete_many([key])
        assert await kvtier("check", "--rest", url, "--token-file", str(token_file)) == 1
        out = capsys.readouterr().out
        assert f"orphans: {NS_HEX}/{keys[0].hex()}" in out and f"missing: {NS_HEX}/{keys[0].hex()}" in out
        assert await kvtier("check", "--rest", url, "--token-file", str(token_file), "--fix", "--json") == 0
        report = json.loads(capsys.readouterr().out)
        assert report["adopted"] == [{"ns": NS_HEX, "hash": keys[0].hex()}]
        assert disk.file_path(key).endswith(f"{fid:016x}")
        assert await kvtier("check", "--rest", url, "--token-file", str(token_file)) == 0
        assert capsys.readouterr().out.startswith("no problems found")


def _tier_with_records(tier: Path, n: int = 40) -> list:
    recs = [make_rec(i) for i in range(n)]
    with DiskTier(tier, 1 << 30) as d:
        d.put_many([(make_key(r.ns_id, r.chain_hash), r.header, r.payload) for r in recs])
        d.flush()
    return recs


def test_check_offline_reports_a_rebuild_and_corrupt_records(tmp_path, capsys):
    data_dir = tmp_path / "data"
    recs = _tier_with_records(data_dir / "disk")
    damage(data_dir / "disk", "truncate-manifest")
    args = parse(["check", "--data-dir", str(data_dir)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"disk tier {data_dir / 'disk'}: problems repaired (40 records, missing 0, corrupt 0")
    assert "repaired at open: metadata damaged (the metadata is new but 40 block files exist)" in out
    with DiskTier(data_dir / "disk", 1 << 30) as d:  # one record's file cut short
        os.truncate(d.file_path(make_key(recs[3].ns_id, recs[3].chain_hash)), 4096)
    args = parse(["check", "--data-dir", str(data_dir / "disk"), "--json"])
    assert args.func(args) == 1  # problems found
    (tier,) = json.loads(capsys.readouterr().out)["tiers"]
    assert tier["corrupt"] == [make_key(recs[3].ns_id, recs[3].chain_hash).hex()] and tier["repair"] is None
    args = parse(["check", "--data-dir", str(data_dir), "--fix"])
    assert args.func(args) == 0
    assert "problems repaired (39 records" in capsys.readouterr().out


def test_check_offline_without_a_tier_is_exit_2_and_while_a_daemon_holds_it_exit_1_one_line(tmp_path, capsys):
    args = parse(["check", "--data-dir", str(tmp_path / "nothing")])
    assert args.func(args) == 2
    assert capsys.readouterr().err == f"kvtier: no disk tier under {tmp_path / 'nothing'}\n"
    _tier_with_records(tmp_path / "data" / "disk", 2)
    with DiskTier(tmp_path / "data" / "disk", 1 << 30):
        args = parse(["check", "--data-dir", str(tmp_path / "data")])
        assert args.func(args) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is in use by another process, pid {os.getpid()}" in err


async def test_daemon_down_is_one_line_and_exit_1(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    for argv in (["status"], ["ls"], ["inspect", NS_HEX, "ab" * 32], ["lookup", "--ns", NS_HEX, "--tokens", "1"],
                 ["clear", "--ns", NS_HEX], ["check"]):
        assert await kvtier(*argv, "--rest", url, "--timeout", "2") == 1
        err = capsys.readouterr().err
        assert err.startswith(f"kvtier: cannot reach the kvtier daemon at {url}") and err.count("\n") == 1
        assert "Traceback" not in err


async def test_registered_through_the_kvtier_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", ("kvtier.commands.admin",))
    async with daemon(tmp_path) as (ctx, url):
        assert await asyncio.to_thread(cli.main, ["status", "--rest", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ready"] is True
