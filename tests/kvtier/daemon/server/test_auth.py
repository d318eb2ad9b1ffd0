"""Auth: configured or generated token, private token file, constant-time checks, no leaks."""

from __future__ import annotations

import hmac
import logging
import os
import stat

import pytest
from kvtier_protocol.errors import Unauthorized

from kvtier.daemon.config import AuthConfig, ConfigError, TenantConfig
from kvtier.daemon.server.auth import Auth, Principal, TokenFileError

SECRET = "s3cret-token-value"


def test_configured_token_is_checked():
    auth = Auth.from_config(AuthConfig(token=SECRET), "/nonexistent")
    assert auth.required and auth.source == "config"
    assert auth.check(SECRET)
    assert not auth.check(SECRET + "x") and not auth.check("") and not auth.check(None)
    assert not auth.check("\udcff")  # a lone surrogate (undecodable text) is just wrong
    auth.require(SECRET)
    with pytest.raises(Unauthorized, match="required"):
        auth.require(None)
    with pytest.raises(Unauthorized, match="wrong"):
        auth.require("nope")


def test_no_token_accepts_anyone():
    auth = Auth(None)
    assert not auth.required and auth.check(None) and auth.check("anything")
    auth.require(None)


def test_token_never_in_repr_or_errors():
    auth = Auth(SECRET)
    assert SECRET not in repr(auth) and SECRET not in str(auth)
    with pytest.raises(Unauthorized) as info:
        auth.require("guess")
    assert SECRET not in str(info.value) and "guess" not in str(info.value)


def test_generated_token_file_is_private_and_reused(tmp_path, caplog):
    data_dir = tmp_path / "state"
    with caplog.at_level(logging.INFO, logger="kvtier.daemon.server.auth"):
        first = Auth.from_config(AuthConfig(), str(data_dir))
    path = data_dir / "token"
    assert first.source == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    assert len(first.token) == 43 and path.read_text() == first.token + "\n"
    assert first.token not in caplog.text and str(path) in caplog.text
    second = Auth.from_config(AuthConfig(), str(data_dir))
    assert second.token == first.token


def test_configured_token_file_path(tmp_path):
    path = tmp_path / "etc" / "kvtier.token"
    auth = Auth.from_config(AuthConfig(token_file=str(path)), str(tmp_path / "unused"))
    assert auth.source == str(path) and path.exists()
    assert not (tmp_path / "unused").exists()


def test_existing_token_file_is_read_stripped(tmp_path):
    path = tmp_path / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"  my-own-token-of-24-chars\n")
    os.close(fd)
    assert Auth.from_config(AuthConfig(token_file=str(path)), str(tmp_path)).token == "my-own-token-of-24-chars"


@pytest.mark.parametrize("token", ["x", "fifteen-chars-x"])
def test_a_short_token_is_refused_from_every_source(tmp_path, token):
    """One rule (MIN_TOKEN_LEN) for the token file, the inline token and a tenant's token."""
    path = tmp_path / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, token.encode() + b"\n")
    os.close(fd)
    with pytest.raises(TokenFileError, match="shorter than 16"):
        Auth.from_config(AuthConfig(token_file=str(path)), str(tmp_path))
    with pytest.raises(ConfigError, match="at least 16"):
        AuthConfig(token=token)
    with pytest.raises(TokenFileError, match="shorter than 16"):
        Auth("a-long-enough-admin-token", tenants={"alice": token})


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_group_or_world_accessible_token_file_is_refused(tmp_path, mode):
    path = tmp_path / "token"
    path.write_text(SECRET)
    path.chmod(mode)
    with pytest.raises(TokenFileError, match="chmod 600") as info:
        Auth.from_config(AuthConfig(token_file=str(path)), str(tmp_path))
    assert isinstance(info.value, ConfigError) and SECRET not in str(info.value)
    assert path.read_text() == SECRET  # left alone


def test_symlinks_and_non_files_are_refused(tmp_path):
    target = tmp_path / "real"
    target.write_text(SECRET)
    target.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(TokenFileError, match="symlink"):
        Auth.from_config(AuthConfig(token_file=str(link)), str(tmp_path))
    folder = tmp_path / "dir"
    folder.mkdir(mode=0o700)
    with pytest.raises(TokenFileError, match="not a regular file"):
        Auth.from_config(AuthConfig(token_file=str(folder)), str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"\n  \n", b"two words", b"\xff\xfe", b"x" * 2000])
def test_malformed_token_files_are_refused(tmp_path, content):
    path = tmp_path / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(TokenFileError):
        Auth.from_config(AuthConfig(token_file=str(path)), str(tmp_path))


@pytest.mark.parametrize("token", ["", "has space", "tab\there", "x" * 1025])
def test_malformed_configured_tokens_are_refused(token):
    with pytest.raises(TokenFileError):
        Auth(token)


def test_uncreatable_token_file_is_a_typed_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TokenFileError, match="Not a directory"):
        Auth.from_config(AuthConfig(token_file=str(blocker / "token")), str(tmp_path))


# --- tenants ---------------------------------------------------------------------------------------

TENANT_A, TENANT_B = "alice-token-0123456789", "bob-token-0123456789"


def test_identify_maps_each_token_to_its_principal():
    auth = Auth(SECRET, tenants={"alice": TENANT_A, "bob": TENANT_B})
    assert auth.identify(SECRET) == Principal(None, True)
    assert auth.identify(TENANT_A) == Principal("alice", False)
    assert auth.identify(TENANT_B) == Principal("bob", False)
    for wrong in (None, "", TENANT_A + "x", "\udcff", SECRET[:-1]):
        assert auth.identify(wrong) is None
    assert auth.check(SECRET) and not auth.check(TENANT_A)  # only the admin's token is "the" token
    assert auth.required and auth.tenants == {"alice", "bob"}
    assert all(t not in repr(auth) for t in (SECRET, TENANT_A, TENANT_B))


def test_without_tokens_everyone_is_the_admin_but_tenant_tokens_still_select():
    assert Auth(None).identify(None) == Auth(None).identify("x") == Principal(None, True)
    auth = Auth(None, tenants={"alice": TENANT_A})
    assert auth.required and auth.identify(TENANT_A) == Principal("alice", False)
    assert auth.identify("other-text") is None


def test_identify_compares_every_token(monkeypatch):
    # No early exit: which principal matched (or whether one did) must not show in the work done.
    auth = Auth(SECRET, tenants={"alice": TENANT_A, "bob": TENANT_B})
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for token in (SECRET, TENANT_A, TENANT_B, "nobody-0123456789"):
        calls.clear()
        auth.identify(token)
        assert len(calls) == 3


def test_shared_tokens_are_refused():
    with pytest.raises(TokenFileError, match="share a token"):
        Auth(SECRET, tenants={"alice": SECRET})
    with pytest.raises(TokenFileError, match="share a token"):
        Auth(None, tenants={"alice": TENANT_A, "bob": TENANT_A})
    with pytest.raises(TokenFileError, match="whitespace"):
        Auth(SECRET, tenants={"alice": "has space inside it"})


def test_tenant_tokens_from_config_and_generated_files(tmp_path):
    given = tmp_path / "bob.token"
    given.write_text(TENANT_B + "\n")
    given.chmod(0o600)
    tenants = (TenantConfig("alice", 1 << 20, 0), TenantConfig("bob", 1 << 20, 0, token_file=str(given)),
               TenantConfig("carol", 1 << 20, 0, token=TENANT_A))
    auth = Auth.from_config(AuthConfig(token=SECRET), str(tmp_path), tenants)
    generated = tmp_path / "tenants" / "alice" / "token"
    assert stat.S_IMODE(generated.stat().st_mode) == 0o600
    assert auth.identify(generated.read_text().strip()) == Principal("alice", False)
    assert auth.identify(TENANT_B) == Principal("bob", False)
    assert auth.identify(TENANT_A) == Principal("carol", False)
    given.chmod(0o644)
    with pytest.raises(TokenFileError, match="group or others"):
        Auth.from_config(AuthConfig(token=SECRET), str(tmp_path), tenants)
