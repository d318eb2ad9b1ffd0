"""The daemon's shared secret: configured, or generated once into a private file; checked in constant time.

The token guards the TCP data plane (always), the unix socket (when configured) and the mutating
REST calls. It never appears in a repr, a log line or an error message: only where it came from
(``source``) is shown.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import stat
from kvtier_protocol.errors import Unauthorized

from kvtier.config import AuthConfig, ConfigError

log = logging.getLogger(__name__)

TOKEN_FILE_NAME = "token"  # under the data (state) directory when no token_file is configured
TOKEN_BYTES = 32  # entropy of a generated token (secrets.token_urlsafe: 43 characters)
MAX_TOKEN_LEN = 1024  # a token travels as a wire `text` (SPEC §7.3)
_PRIVATE_BITS = stat.S_IRWXG | stat.S_IRWXO  # any group or world permission makes a file public


class TokenFileError(ConfigError):
    """The token setting or token file cannot be used (unsafe permissions, unreadable, malformed).

    A ConfigError, so that start-up reports it as bad configuration rather than as a crash.
    """


class Auth:
    """The daemon's token, if any, and the checks against it.

    Args:
        token: the shared secret; None means no token is configured (``check`` accepts anyone).
        source: where the token came from (``"config"`` or the file path), for logs.

    Raises:
        TokenFileError: a token that is empty, too long, or holds whitespace or control
            characters (it could not be typed or sent as wire text reliably).
    """

    __slots__ = ("token", "source")

    def __init__(self, token: str | None, source: str = "config") -> None:
        if token is not None:
            _check_token(token, source)
        self.token = token
        self.source = source

    @classmethod
    def from_config(cls, cfg: AuthConfig, data_dir: str) -> Auth:
        """The configured token, else the one in the token file, generated there when missing.

        Args:
            cfg: ``token`` (used as is) or ``token_file`` (default ``<data_dir>/token``).
            data_dir: the daemon's state directory.

        Raises:
            TokenFileError: the token file is group- or world-accessible, not a regular file,
                unreadable, or holds no valid token; or it cannot be created.
        """
        if cfg.token is not None:
            return cls(cfg.token, "config")
        path = cfg.token_file or os.path.join(data_dir, TOKEN_FILE_NAME)
        token = _read_token_file(path)
        if token is None:
            token = _generate_token_file(path)
        return cls(token, path)

    @property
    def required(self) -> bool:
        """Whether a token is configured (then TCP clients must present it)."""
        return self.token is not None

    def check(self, presented: str | None) -> bool:
        """Whether ``presented`` is the token; True when no token is configured.

        Constant time in the token's content (``hmac.compare_digest``), so a client cannot learn
        the token byte by byte from response times.
        """
        if self.token is None:
            return True
        if not isinstance(presented, str):
            return False
        return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"),
                                   self.token.encode("utf-8"))

    def require(self, presented: str | None) -> None:
        """Raises Unauthorized unless :meth:`check` accepts ``presented``."""
        if not self.check(presented):
            raise Unauthorized("a valid token is required" if presented is None
                               else "wrong token")

    def __repr__(self) -> str:
        return f"Auth(token={'<set>' if self.token is not None else None}, source={self.source!r})"


def _check_token(token: object, source: str) -> None:
    if not isinstance(token, str) or not token:
        raise TokenFileError(f"the token from {source} is empty")
    if len(token) > MAX_TOKEN_LEN:
        raise TokenFileError(f"the token from {source} is longer than {MAX_TOKEN_LEN} characters")
    if not token.isprintable() or any(c.isspace() for c in token):
        raise TokenFileError(f"the token from {source} holds whitespace or control characters")


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
