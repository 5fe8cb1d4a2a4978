"""Certificates made per test run with trustme: a CA, leaves for localhost / 127.0.0.1, a
wrong-name leaf, an expired one, a client certificate, and a second CA nobody trusts. Written as
PEM files in a directory, since the sidecar, nginx and curl read files.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import trustme

_LONG_AGO = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)


@dataclass(frozen=True)
class Pair:
    cert: str  # PEM chain: leaf first, then the CA
    key: str


@dataclass(frozen=True)
class CertSet:
    dir: Path
    ca: str  # the CA every pair below is signed by
    other_ca: str  # a CA that signed nothing here (a trust store that knows none of them)
    server: Pair  # localhost, 127.0.0.1, ::1
    wrong_name: Pair  # only "elsewhere.example"
    expired: Pair  # localhost, 127.0.0.1, expired in 2000
    client: Pair  # a client certificate, "client.example"
    ca_obj: trustme.CA

    def issue(self, name: str, *hosts: str) -> Pair:
        """Another leaf of the same CA, in files named ``name``."""
        return _write(self.dir, name, self.ca_obj.issue_cert(*hosts))


def _write(where: Path, name: str, leaf: trustme.LeafCert) -> Pair:
    cert, key = where / f"{name}.pem", where / f"{name}.key"
    cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    return Pair(str(cert), str(key))


def make(where: Path) -> CertSet:
    where.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    other = trustme.CA()
    ca.cert_pem.write_to_path(str(where / "ca.pem"))
    other.cert_pem.write_to_path(str(where / "other-ca.pem"))
    return CertSet(
        dir=where,
        ca=str(where / "ca.pem"),
        other_ca=str(where / "other-ca.pem"),
        server=_write(where, "server", ca.issue_cert("localhost", "127.0.0.1", "::1")),
        wrong_name=_write(where, "wrong-name", ca.issue_cert("elsewhere.example")),
        expired=_write(
            where,
            "expired",
            ca.issue_cert(
                "localhost",
                "127.0.0.1",
                not_before=_LONG_AGO,
                not_after=_LONG_AGO + datetime.timedelta(days=1),
            ),
        ),
        client=_write(where, "client", ca.issue_cert("client.example")),
        ca_obj=ca,
    )
