"""TLS: a route's ``tls:`` section (how the sidecar verifies and identifies itself to an
``https://`` upstream) and the top-level ``server_tls:`` (the proxy listener speaking TLS).
Declared once here (``sidecar/config/schema.py``).

The files are read with Python's ``ssl`` module (OpenSSL) when the config is parsed, so that
``validate`` and a reload refuse a missing file, a file that does not parse or a certificate
and key that do not match, naming the key. What a certificate says (subject, expiry) is read
with ``cryptography``'s X.509 parser. The contexts themselves are built here too, one way for
every user: ``client_context`` for an upstream, ``server_context`` for the listener.
"""

from __future__ import annotations

import hashlib
import ipaddress
import ssl
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from sidecar.config import checks as c
from sidecar.config.schema import key, rule

TlsVersion = Literal["1.2", "1.3"]
TLS_VERSIONS: tuple[TlsVersion, ...] = ("1.2", "1.3")
_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
Problems = list[tuple[str, str]]


def _optional_path(value: object) -> str | None:
    if value is None:
        return None
    return c.non_empty_str(value)


def _optional_name(value: object) -> str | None:
    """A host name (or an IP address: then no SNI is sent and the certificate's IP entries are
    verified, as curl does); never a pattern: ``*.example.com`` would be sent as SNI and match
    only a wildcard certificate, literally."""
    if value is None:
        return None
    name = c.non_empty_str(value)
    if any(ch in name for ch in "*/?#@ \t") or name.startswith(".") or ":" in name.strip("[]"):
        if ":" in name and _is_ip(name.strip("[]")):
            return name.strip("[]")
        raise c.Invalid(f"expected a host name such as api.example.com, got {value!r}")
    return name


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class RouteTls:
    """How a route's ``https://`` upstreams are verified and what the sidecar presents."""

    ca_file: str | None = key(
        None,
        _optional_path,
        note="PEM bundle to verify the upstream; null: the system's trust store",
        help="PEM bundle the upstream's certificate is verified against; null: the system's",
    )
    server_name: str | None = key(
        None,
        _optional_name,
        note="SNI and the name verified; null: the upstream URL's host",
        help="the name sent as SNI and verified in the certificate; null: the URL's host",
    )
    client_cert: str | None = key(
        None,
        _optional_path,
        note="PEM certificate for mutual TLS (needs client_key)",
        help="PEM certificate (chain) presented for mutual TLS; needs `client_key`",
    )
    client_key: str | None = key(None, _optional_path, help="the PEM key of `client_cert`")
    verify: bool = key(
        True,
        c.boolean,
        note="false: no verification (warned at start, in explain and on the status page)",
        help=(
            "false: the upstream's certificate is not verified (a warning at start, in "
            "`explain` and on the status page); as curl and requests, verified by default"
        ),
    )
    min_version: TlsVersion = key("1.2", c.Choice(TLS_VERSIONS), help="`1.2` or `1.3`")


@rule(RouteTls)
def _route_tls(t: RouteTls, written: Collection[str]) -> tuple[RouteTls, Problems]:
    problems: Problems = []
    if (t.client_cert is None) != (t.client_key is None):
        missing = "client_key" if t.client_key is None else "client_cert"
        problems.append((missing, "client_cert and client_key are given together"))
        return t, problems
    if t.ca_file is not None:
        problems += [("ca_file", m) for m in ca_problems(t.ca_file)]
    if t.client_cert is not None and t.client_key is not None:
        problems += pair_problems(t.client_cert, t.client_key, "client_cert", "client_key")
    return t, problems


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The proxy listener over TLS (HTTP/1.1 over TLS), with mutual TLS by ``client_ca_file``."""

    cert_file: str | None = key(
        None,
        _optional_path,
        live=False,
        note="set both: the proxy listener speaks TLS; re-read when the files change",
        help=(
            "PEM certificate (chain) of the listener; with `key_file` set the proxy listener "
            "speaks TLS. Both files are re-read when they change on disk (a Secret volume's "
            "symlink swap): new handshakes get the new pair, open connections stay; a broken "
            "pair is refused with a log line and the old one keeps serving"
        ),
    )
    key_file: str | None = key(None, _optional_path, live=False, help="the PEM key of `cert_file`")
    client_ca_file: str | None = key(
        None,
        _optional_path,
        live=False,
        note="set: clients must present a certificate signed by it (mutual TLS)",
        help="PEM bundle: clients must present a certificate signed by it (mutual TLS)",
    )
    min_version: TlsVersion = key("1.2", c.Choice(TLS_VERSIONS), live=False, help="`1.2` or `1.3`")

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


@rule(ServerTls)
def _server_tls(t: ServerTls, written: Collection[str]) -> tuple[ServerTls, Problems]:
    problems: Problems = []
    if (t.cert_file is None) != (t.key_file is None):
        missing = "key_file" if t.key_file is None else "cert_file"
        return t, [(missing, "cert_file and key_file are given together")]
    if t.client_ca_file is not None:
        if t.cert_file is None:
            problems.append(("client_ca_file", "needs cert_file and key_file (a TLS listener)"))
        problems += [("client_ca_file", m) for m in ca_problems(t.client_ca_file)]
    if t.cert_file is not None and t.key_file is not None:
        problems += pair_problems(t.cert_file, t.key_file, "cert_file", "key_file")
    return t, problems


# --- the files -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CertInfo:
    """What a certificate file's first (leaf) certificate says, as the status page shows it."""

    path: str
    subject: str
    issuer: str
    not_before: float  # Unix time
    not_after: float  # Unix time
    sha256: str  # of the DER certificate, hex

    def seconds_left(self, now: float) -> float:
        return self.not_after - now


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None


def read_certs(path: str) -> list[x509.Certificate]:
    """The PEM certificates in ``path``; ValueError (with a reason) if none or unreadable."""
    data = _read(path)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ValueError(f"{path} holds no PEM certificate") from None
    return certs


def cert_info(path: str) -> CertInfo:
    """The leaf (first) certificate of ``path``; ValueError if the file holds none."""
    leaf = read_certs(path)[0]
    der = leaf.public_bytes(serialization.Encoding.DER)
    return CertInfo(
        path=path,
        subject=leaf.subject.rfc4514_string(),
        issuer=leaf.issuer.rfc4514_string(),
        not_before=leaf.not_valid_before_utc.timestamp(),
        not_after=leaf.not_valid_after_utc.timestamp(),
        sha256=hashlib.sha256(der).hexdigest(),
    )


def ca_problems(path: str) -> list[str]:
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        read_certs(path)
        ctx.load_verify_locations(cafile=path)
    except (ValueError, ssl.SSLError, OSError) as e:
        return [_reason(e, path)]
    return []


def pair_problems(cert: str, key_file: str, cert_key: str, key_key: str) -> Problems:
    """A certificate file and its key: each readable, parsed, and matching each other."""
    for path, name in ((cert, cert_key), (key_file, key_key)):
        try:
            _read(path)
        except ValueError as e:
            return [(name, str(e))]
    try:
        read_certs(cert)
    except ValueError as e:
        return [(cert_key, str(e))]
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key_file, no_passphrase)
    except EncryptedKey as e:
        return [(key_key, f"{key_file}: {e}")]
    except (ssl.SSLError, OSError) as e:
        return [(key_key, f"{key_file} does not parse or does not match {cert}: {e}")]
    return []


class EncryptedKey(ValueError):
    """A key file that asks for a passphrase: the sidecar has none to give."""


def no_passphrase() -> str:
    """The ``password`` of every key load: OpenSSL asks for one only for an encrypted key, and
    without a callback it would prompt on the terminal and block the event loop."""
    raise EncryptedKey("the key is encrypted (a passphrase is asked): give it unencrypted")


def _reason(e: BaseException, path: str) -> str:
    if isinstance(e, ValueError):
        return str(e)
    return f"{path}: {e}"


# --- the contexts --------------------------------------------------------------------------


def client_context(tls: RouteTls) -> ssl.SSLContext:
    """The context for a route's ``https://`` upstreams: chain and host name verified against
    ``ca_file`` or the system's store unless ``verify`` is false; the client pair presented for
    mutual TLS. Raises ``ssl.SSLError``/``OSError``/``ValueError`` on files gone bad since
    they were checked."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = _VERSIONS[tls.min_version]
    if tls.verify:
        ctx.check_hostname = True
        ctx.verify_mode = ssl.CERT_REQUIRED
        if tls.ca_file is not None:
            ctx.load_verify_locations(cafile=tls.ca_file)
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    else:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.client_cert is not None and tls.client_key is not None:
        ctx.load_cert_chain(tls.client_cert, tls.client_key, no_passphrase)
    return ctx


def server_context(tls: ServerTls, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
    """The listener's context from the files as they are now; raises as ``client_context``."""
    assert tls.cert_file is not None and tls.key_file is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[tls.min_version]
    ctx.load_cert_chain(tls.cert_file, tls.key_file, no_passphrase)
    if tls.client_ca_file is not None:
        ctx.load_verify_locations(cafile=tls.client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(list(alpn))
    return ctx


def utc_text(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
