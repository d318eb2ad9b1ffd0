"""Certificates for a TLS cluster in the fabric: a throw-away CA and one server certificate whose
subjectAltName lists the hosts' addresses (clients check the address they dial). Made with the
``openssl`` command (Debian's ``openssl``, which ``ca-certificates`` pulls in)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: ``ca`` (the CA certificate clients trust), ``cert`` and ``key`` (the servers')."""

    ca: Path
    cert: Path
    key: Path


def make_tls(workdir: Path, addresses: Sequence[str]) -> TlsFiles:
    """A CA and a server certificate for ``addresses`` (IPs), valid for a day, in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    ca, ca_key = workdir / "ca.pem", workdir / "ca.key"
    cert, key, csr = workdir / "server.pem", workdir / "server.key", workdir / "server.csr"
    ext = workdir / "san.ext"
    ext.write_text("subjectAltName=" + ",".join(f"IP:{a}" for a in addresses) + "\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
            "-days", "1", "-subj", "/CN=kvtier-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", "/CN=kvtier-test-cluster")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "1", "-extfile", str(ext))
    return TlsFiles(ca, cert, key)
