"""The daemon's secrets: configured, or generated once into private files; checked in constant time.

The main token is the admin's: it guards the TCP data plane (always), the unix socket (when
configured) and the mutating REST calls, and it sees every tenant in REST. Each tenant
(``[tenants.<name>]``) has a token of its own, which selects that tenant's store and nothing else.
:meth:`Auth.identify` maps a presented token to its :class:`Principal`. No token ever appears in
a repr, a log line or an error message: only where it came from (``source``) is shown.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier_protocol.errors import Unauthorized

from kvtier.daemon.config import AuthConfig, ConfigError
from kvtier.daemon.config.values import MIN_TOKEN_LEN

if TYPE_CHECKING:
    from kvtier.daemon.config import TenantConfig

log = logging.getLogger(__name__)

TOKEN_FILE_NAME = "token"  # under the data (state) directory when no token_file is configured
TOKEN_BYTES = 32  # entropy of a generated token (secrets.token_urlsafe: 43 characters)
MAX_TOKEN_LEN = 1024  # a token travels as a wire `text` (SPEC §7.3)
_PRIVATE_BITS = stat.S_IRWXG | stat.S_IRWXO  # any group or world permission makes a file public


class TokenFileError(ConfigError):
    """The token setting or token file cannot be used (unsafe permissions, unreadable, malformed).

    A ConfigError, so that start-up reports it as bad configuration rather than as a crash.
    """


@dataclass(frozen=True, slots=True)
class Principal:
    """Who presented a token.

    Attributes:
        tenant: the tenant whose token it is; None for the admin (main) token.
        admin: the main token: the default store on the data plane, every tenant in REST.
    """

    tenant: str | None
    admin: bool


ADMIN = Principal(None, True)


class Auth:
    """The daemon's tokens, if any, and the checks against them.

    Args:
        token: the admin's shared secret; None means no token is configured (``check`` accepts
            anyone, and a caller without a token is the admin).
        source: where the token came from (``"config"`` or the file path), for logs.
        tenants: each tenant's token, by tenant name.

    Raises:
        TokenFileError: a token that is empty, shorter than :data:`MIN_TOKEN_LEN` (the same rule
            for every source: inline, environment, token file), too long, or holds whitespace or control
            characters (it could not be typed or sent as wire text reliably), or two principals
            that share a token.
    """

    __slots__ = ("token", "source", "tenants", "_table")

    def __init__(self, token: str | None, source: str = "config", tenants: Mapping[str, str] | None = None) -> None:
        if token is not None:
            _check_token(token, source)
        tenants = dict(tenants or {})
        for name, tenant_token in tenants.items():
            _check_token(tenant_token, f"tenant {name}")
        table = [(Principal(name, False), t.encode("utf-8")) for name, t in sorted(tenants.items())]
        if token is not None:
            table.insert(0, (ADMIN, token.encode("utf-8")))
        if len({t for _, t in table}) != len(table):
            raise TokenFileError("two principals (tenants, or a tenant and the admin) share a token")
        self.token = token
        self.source = source
        self.tenants = frozenset(tenants)  # the names; the tokens live only in _table
        self._table = tuple(table)

    @classmethod
    def from_config(cls, cfg: AuthConfig, data_dir: str, tenants: Sequence[TenantConfig] = ()) -> Auth:
        """The configured tokens, else the ones in the token files, generated there when missing.

        Args:
            cfg: ``token`` (used as is) or ``token_file`` (default ``<data_dir>/token``).
            data_dir: the daemon's state directory.
            tenants: each tenant's ``token`` or ``token_file`` (default
                ``<data_dir>/tenants/<name>/token``).

        Raises:
            TokenFileError: a token file is group- or world-accessible, not a regular file,
                unreadable, or holds no valid token; or it cannot be created; or two principals
                share a token.
        """
        path = "config" if cfg.token is not None else cfg.token_file or os.path.join(data_dir, TOKEN_FILE_NAME)
        token = cfg.token if cfg.token is not None else _token_from_file(path)
        tenant_tokens = {t.name: t.token if t.token is not None else
                         _token_from_file(t.token_file or t.default_token_file(data_dir)) for t in tenants}
        return cls(token, path, tenant_tokens)

    @property
    def required(self) -> bool:
        """Whether a token is configured (then TCP clients must present one)."""
        return self.token is not None or bool(self.tenants)

    def identify(self, presented: str | None) -> Principal | None:
        """The principal whose token ``presented`` is; None for no or an unknown token.

        Without any token configured, a caller without a token is the admin. Every configured
        token is compared (``hmac.compare_digest``, no early exit), so response times reveal
        neither a token's bytes nor which principal matched.
        """
        if not isinstance(presented, str):
            return ADMIN if self.token is None and presented is None else None
        raw = presented.encode("utf-8", "surrogatepass")
        found: Principal | None = None
        for principal, token in self._table:
            if hmac.compare_digest(raw, token):
                found = principal
        if found is None and self.token is None:
            return ADMIN if not self.tenants else None
        return found

    def check(self, presented: str | None) -> bool:
        """Whether ``presented`` is the admin token; True when no admin token is configured.

        Constant time in the token's content (``hmac.compare_digest``), so a client cannot learn
        the token byte by byte from response times.
        """
        if self.token is None:
            return True
        principal = self.identify(presented)
        return principal is not None and principal.admin

    def require(self, presented: str | None) -> None:
        """Raises Unauthorized unless :meth:`check` accepts ``presented``."""
        if not self.check(presented):
            raise Unauthorized("a valid token is required" if presented is None
                               else "wrong token")

    def __repr__(self) -> str:
        return (f"Auth(token={'<set>' if self.token is not None else None}, source={self.source!r}, "
                f"tenants={sorted(self.tenants)})")


def _check_token(token: object, source: str) -> None:
    if not isinstance(token, str) or not token:
        raise TokenFileError(f"the token from {source} is empty")
    if len(token) < MIN_TOKEN_LEN:  # a short token can be guessed; the rule of auth.token, for every source
        raise TokenFileError(f"the token from {source} is shorter than {MIN_TOKEN_LEN} characters")
    if len(token) > MAX_TOKEN_LEN:
        raise TokenFileError(f"the token from {source} is longer than {MAX_TOKEN_LEN} characters")
    if not token.isprintable() or any(c.isspace() for c in token):
        raise TokenFileError(f"the token from {source} holds whitespace or control characters")


def _token_from_file(path: str) -> str:
    """The token in ``path``, generated there when the file is missing."""
    token = _read_token_file(path)
    return token if token is not None else _generate_token_file(path)


def _read_token_file(path: str) -> str | None:
    """The token in ``path``, or None when the file does not exist."""
    try:
        # O_NOFOLLOW + fstat on the open descriptor: the file checked is the file read.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        hint = " (a symlink is refused)" if e.errno == errno.ELOOP else ""
        raise TokenFileError(f"cannot open token file {path}{hint}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"token file {path} is not a regular file")
        if st.st_mode & _PRIVATE_BITS:
            raise TokenFileError(f"token file {path} has mode {stat.S_IMODE(st.st_mode):04o}: it must "
                                 f"not be accessible to group or others (chmod 600 {path})")
        data = os.read(fd, MAX_TOKEN_LEN + 2)
    except OSError as e:
        raise TokenFileError(f"cannot read token file {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise TokenFileError(f"token file {path} is not UTF-8 text") from None
    _check_token(token, path)
    return token


def _generate_token_file(path: str) -> str:
    """Create ``path`` (mode 0600, must not exist) holding a fresh token; returns the token.

    If another process creates the file first, its token is used instead.
    """
    parent = os.path.dirname(path) or "."
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        token = _read_token_file(path)
        if token is None:
            raise TokenFileError(f"token file {path} vanished while it was being created") from None
        return token
    except OSError as e:
        raise TokenFileError(f"cannot create token file {path}: {e.strerror}") from None
    token = secrets.token_urlsafe(TOKEN_BYTES)
    try:
        os.fchmod(fd, 0o600)  # the umask may only remove bits; be explicit all the same
        os.write(fd, (token + "\n").encode("ascii"))
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        os.unlink(path)  # a half-written token file would lock every client out after restart
        raise TokenFileError(f"cannot write token file {path}: {e.strerror}") from None
    os.close(fd)
    log.info("generated a token in %s", path)
    return token
