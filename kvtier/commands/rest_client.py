"""A minimal JSON client of the daemon's REST API for the admin commands (standard library only).

Where the daemon is and which token to send come from, first to last: the command's flags,
``$KVTIER_REST``, the daemon configuration (``kvtier.daemon.config.load_config``: ``--config`` or
``$KVTIER_CONFIG``, ``KVTIER_*`` variables, embedded defaults), then ``http://127.0.0.1:7471``.
Proxies are never used: the daemon listens on a local address.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


USER_ERROR = 2
"""Exit status of a user error: input, option, file or token the user must fix, or a request the
daemon refused as invalid (HTTP 4xx). The same status argparse gives for bad usage."""
FAILED = 1
"""Exit status of a command that could not do its work: the daemon unreachable, failing (HTTP 5xx)
or not a kvtier daemon, or a check that found problems."""


class CommandError(Exception):
    """A failure to report as one line on stderr, without a traceback; ``status`` is the exit status
    (:data:`USER_ERROR` unless the daemon, not the user, is the problem: :data:`FAILED`)."""

    def __init__(self, message: str, status: int = USER_ERROR) -> None:
        super().__init__(message)
        self.status = status


_ANY_HOST = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}


def rest_url(value: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT`` as a base URL (a wildcard host becomes loopback)."""
    value = value.strip().rstrip("/")
    if "://" in value:
        return value
    host, sep, port = value.rpartition(":")
    if not sep:
        raise CommandError(f"REST address {value!r} is neither http://HOST:PORT nor HOST:PORT")
    return f"http://{_ANY_HOST.get(host, host)}:{port}"


def _read_token(path: str, *, missing_ok: bool) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise CommandError(f"token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read token file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return token or None


class RestClient:
    """JSON over HTTP to one daemon.

    Args:
        base: e.g. ``http://127.0.0.1:7471``.
        timeout: seconds per request.
        token: sent as ``Authorization: Bearer`` when a call asks for it; None: none known.
        token_hint: where the token was looked for, for the 401 message.
        tenant: the tenant whose store every call works on (``?tenant=``). None: the store the
            token selects (the default store for the admin's token or none).
        always: send the token with every call, reads too (reads of the store need a token
            unless the daemon has ``rest.public_reads``; a tenant's token selects its store;
            ``--tenant`` needs a token); else only where a call asks for it.
    """

    def __init__(self, base: str, timeout: float, token: str | None = None, token_hint: str = "",
                 tenant: str | None = None, always: bool = False) -> None:
        import urllib.request

        self.base = base
        self.tenant = tenant
        self._always = always or tenant is not None
        self.timeout = timeout
        self._token = token
        self._token_hint = token_hint
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RestClient:
        """The client the command's flags, the environment and the configuration describe."""
        env = dict(os.environ)
        env_rest = env.pop("KVTIER_REST", None)  # here it may also be a URL, which the config refuses
        cfg = _load_config(args.config, env)
        if args.rest:
            base = rest_url(args.rest)
        elif env_rest:
            base = rest_url(env_rest)
        elif cfg is not None and cfg.rest.listen is None:
            raise CommandError("REST is switched off in the daemon configuration (rest.listen); pass --rest URL")
        else:
            base = rest_url(cfg.rest.listen) if cfg is not None and cfg.rest.listen else "http://127.0.0.1:7471"
        token, hint = None, "pass --token-file FILE or set KVTIER_TOKEN"
        tenant = getattr(args, "tenant", None)
        # Reads of the store need a token too (unless the daemon has rest.public_reads): a
        # read-only command looks for one the same way, but does without when none is readable.
        required = bool(getattr(args, "needs_token", False) or tenant)
        if getattr(args, "token_file", None):
            token = _read_token(args.token_file, missing_ok=False)
        elif cfg is not None and cfg.auth.token:
            token = _token_value(cfg.auth.token)
        elif cfg is not None:
            path = cfg.auth.token_file or os.path.join(cfg.data_dir, "token")
            try:
                token = _read_token(path, missing_ok=cfg.auth.token_file is None or not required)
            except CommandError:
                if required:
                    raise
            hint = f"no readable token in {path}; " + hint
        elif env.get("KVTIER_TOKEN"):
            token = _token_value(env["KVTIER_TOKEN"].strip())
        return cls(base, args.timeout, token, hint, tenant, always=True)

    def get(self, path: str, *, ok_statuses: tuple[int, ...] = ()) -> Any:
        """GET ``path``; the decoded JSON answer. ``ok_statuses``: error statuses to return, not raise."""
        return self._call("GET", path, None, False, self.timeout, ok_statuses)

    def post(self, path: str, body: Any, *, token: bool = False, timeout: float | None = None) -> Any:
        """POST a JSON body; the decoded JSON answer."""
        return self._call("POST", path, body, token, timeout or self.timeout, ())

    def _call(self, method: str, path: str, body: Any, token: bool, timeout: float,
              ok_statuses: tuple[int, ...]) -> Any:
        import http.client
        import urllib.error
        import urllib.request

        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if (token or self._always) and self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        if self.tenant is not None:
            from urllib.parse import quote

            path += ("&" if "?" in path else "?") + "tenant=" + quote(self.tenant, safe="")
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return _decode(resp.read(), self.base)
        except urllib.error.HTTPError as exc:
            answer = _decode(exc.read(), self.base, strict=False)
            if exc.code in ok_statuses and isinstance(answer, dict):
                return answer
            raise CommandError(self._refusal(exc.code, answer), FAILED if exc.code >= 500 else USER_ERROR) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise CommandError(f"cannot reach the kvtier daemon at {self.base} ({reason}); "
                               f"is `kvtier serve` running?", FAILED) from None

    def _refusal(self, status: int, answer: Any) -> str:
        err = answer.get("error") if isinstance(answer, dict) else None
        if not isinstance(err, dict):
            return f"the daemon at {self.base} answered HTTP {status}"
        text = f"{err.get('code', 'error')}: {err.get('message', '')}"
        return text + f" ({self._token_hint})" if status == 401 else text


def _token_value(token: str) -> str:
    """``KVTIER_TOKEN`` / ``auth.token`` as the token itself; refused when it names a file (see
    :data:`kvtier.commands.serve.TOKEN_RULE`)."""
    from kvtier.commands.serve import token_value_problem

    problem = token_value_problem(token, "KVTIER_TOKEN (auth.token)")
    if problem is not None:
        raise CommandError(problem)
    return token


def _decode(raw: bytes, base: str, *, strict: bool = True) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        if not strict:
            return None
        raise CommandError(f"{base} did not answer JSON; is it a kvtier daemon?", FAILED) from None


def _load_config(path: str | None, env: dict[str, str]) -> Any:
    """The daemon configuration, or None when none can be built and none was asked for."""
    from kvtier.daemon.config import ConfigError, load_config

    try:
        return load_config(path, env=env)
    except (ConfigError, OSError) as exc:
        if path is not None or env.get("KVTIER_CONFIG"):
            raise CommandError(f"configuration: {exc}") from None
        return None  # the defaults could not be computed here; the built-in address still works
