"""``kvtier inspect`` and ``GET /v1/blocks/{ns}/{hash}`` take a unique prefix of the chain hash
(``kvtier ls`` prints 16 digits); an ambiguous one is refused with a few of the blocks it matches."""

from __future__ import annotations

import random

from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum

from kvtier.daemon.server.rest_views import MAX_LISTED_MATCHES
from tests.kvtier.commands.test_admin import clean_env, daemon, kvtier  # noqa: F401 (clean_env: autouse)
from tests.kvtier.daemon.server.restkit import NS, NS_HEX
from tests.kvtier.daemon.store.storekit import BLOCK, Rec, put


def rec(chain_hash: bytes) -> Rec:
    payload = random.Random(chain_hash).randbytes(BLOCK)
    h = BlockHeader(ns_id=NS.ns_id, chain_hash=chain_hash, parent_hash=None, num_tokens=16, layout="canonical",
                    shape=(1, 2, 1, 16, 64), dtype="float16", codec="raw", sections=(Section("payload", 0, BLOCK),),
                    payload_len=BLOCK, checksum=payload_checksum(payload))
    return Rec(NS.ns_id, chain_hash, encode_header(h), payload)


async def store_all(store) -> None:
    """Two at a time: older blocks go down to disk as host memory fills."""
    for i in range(0, len(HASHES), 2):
        assert await put(store, [rec(h) for h in HASHES[i:i + 2]]) == [True] * len(HASHES[i:i + 2])


# abcd0101..., abcd0202..., ..., abcd0808... and one that shares no prefix with them: 1234...
HASHES = [bytes([0xAB, 0xCD, i, i]) + bytes(28) for i in range(1, 9)] + [bytes([0x12, 0x34]) + bytes(30)]


async def test_a_unique_prefix_names_one_block(tmp_path, capsys):
    async with daemon(tmp_path) as (ctx, url):
        await store_all(ctx.store)
        for prefix in ("1234", "12340", "abcd0303", "ABCD0303", "abcd030", HASHES[2].hex()[:16], HASHES[2].hex()):
            assert await kvtier("inspect", "--rest", url, NS_HEX, prefix) == 0, prefix
            rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines()[1:])
            want = HASHES[-1] if prefix.startswith("1234") else HASHES[2]
            assert rows["hash"] == want.hex(), prefix


async def test_an_ambiguous_prefix_lists_a_few_matches_and_how_many_more(tmp_path, capsys):
    async with daemon(tmp_path) as (ctx, url):
        await store_all(ctx.store)
        assert await kvtier("inspect", "--rest", url, NS_HEX, "abcd") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvtier: invalid_key: hash prefix abcd is ambiguous: 8 blocks")
        shown = [h.hex() for h in HASHES[:MAX_LISTED_MATCHES]]
        assert all(s in err for s in shown) and HASHES[MAX_LISTED_MATCHES].hex() not in err
        assert f"and {8 - MAX_LISTED_MATCHES} more" in err
        assert await kvtier("inspect", "--rest", url, NS_HEX, "abcd0") == 2  # abcd01.., abcd02.., ...: all 8 again
        assert "8 blocks match" in capsys.readouterr().err


async def test_no_match_and_bad_prefixes_are_one_line(tmp_path, capsys):
    async with daemon(tmp_path) as (ctx, url):
        await store_all(ctx.store)
        assert await kvtier("inspect", "--rest", url, NS_HEX, "ffff") == 2
        assert capsys.readouterr().err.startswith("kvtier: not_found: no block of namespace")
        for bad in ("abc", "abcx", "ab" * 33):
            assert await kvtier("inspect", "--rest", url, NS_HEX, bad) == 2
            err = capsys.readouterr().err
            assert err.startswith("kvtier: invalid_key: hash must be 64 hex digits, or a unique prefix"), err
