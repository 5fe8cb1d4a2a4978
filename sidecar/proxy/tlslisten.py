"""The proxy listener over TLS: uvloop's own TLS (OpenSSL through Python's ``ssl``), with three
things it does not give by itself.

- The pair in force changes without a restart: the listening socket is given a
  ``SwitchingContext``, whose ``wrap_bio`` (the one call uvloop makes on it, once per accepted
  connection) hands each new connection to the context now in force (``proxy/certreload.py``
  builds it from the files). A connection keeps the context it was accepted with, so one open
  across a rotation is never touched.
- Each handshake's result is counted (``retry_sidecar_tls_handshakes_total{side="listener"}``):
  uvloop reports a failed handshake to nobody (an ``OSError`` is logged only in debug mode), so
  the contexts make their connections' ``SSLObject`` of a class that reports how its
  ``do_handshake`` ended, and, for a handshake that never ends (the client gone, the timeout),
  that it was dropped unfinished.
- The handshake is bounded: ``TlsSite`` passes ``ssl_handshake_timeout`` (aiohttp's site does
  not), the head deadline (``limits.header_timeout``) as in force at start; a client that opens
  TCP and never finishes the handshake is closed then, its socket given back. The head that
  follows has what is left of the same deadline (``GuardedRequestHandler.connection_made``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from cryptography import x509

from sidecar import outcomes
from sidecar.outcomes import OutcomeKind
from sidecar.telemetry.logs import RateLimit

log = logging.getLogger("sidecar.tls")

# The ALPN protocols the listener offers, preferred first: an "h2" connection goes to the HTTP/2
# front end (proxy/h2listen.py).
ALPN = ("h2", "http/1.1")

# retry_sidecar_tls_handshakes_total{side="listener", result}
OK = "ok"
# The outcome table's names: a listener's handshake fails the ways an upstream's does.
# (read through BY_KIND, whose type is declared: mypyc's build cannot always infer a row's)
_ROW = outcomes.BY_KIND
CERTIFICATE: str = _ROW[OutcomeKind.TLS_CERTIFICATE].name  # the client's certificate refused
HANDSHAKE: str = _ROW[OutcomeKind.TLS_HANDSHAKE].name  # protocol, an alert, no certificate
GONE: str = _ROW[OutcomeKind.CONNECT_FAILURE].name  # the client left or timed out before the end
RESULTS = (OK, CERTIFICATE, HANDSHAKE, GONE)

Report = Callable[[str, str], None]  # (result, reason: "" for ok)


def handshake_result(exc: BaseException | None) -> str:
    """The ``result`` label of a listener handshake that ended with ``exc`` (None: it
    completed)."""
    if exc is None:
        return OK
    if isinstance(exc, ssl.SSLCertVerificationError):
        return CERTIFICATE
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)):
        return GONE
    if isinstance(exc, ssl.SSLError):
        return HANDSHAKE
    return GONE


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"client certificate refused: {exc.verify_message}"
    reason = getattr(exc, "reason", None)
    return str(reason) if reason else str(exc)


def reporting_class(report: Report) -> type[ssl.SSLObject]:
    """An ``SSLObject`` class whose handshake tells ``report`` how it ended."""

    class ReportingSSLObject(ssl.SSLObject):
        _ended = False
        accepted_at = 0.0  # time.monotonic() when the connection was handed its context

        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise
            except ssl.SSLError as e:
                self._ended = True
                report(handshake_result(e), reason_of(e))
                raise
            self._ended = True
            report(OK, "")

        def __del__(self) -> None:
            if not self._ended:  # the connection closed before its handshake ended
                self._ended = True
                report(GONE, "the client left or timed out during the handshake")

    return ReportingSSLObject


def listener_reports(count: Callable[[str], None]) -> Callable[[ssl.SSLContext], None]:
    """What each new listener context is prepared with: its connections report their
    handshake to ``count`` (by result); a refused one is logged, at a bounded rate."""
    limit = RateLimit(per_interval=10, interval=60.0)

    def report(result: str, reason: str) -> None:
        count(result)
        if result in (CERTIFICATE, HANDSHAKE) and limit.allow():
            log.warning("a TLS handshake on the listener failed (%s): %s", result, reason)

    cls = reporting_class(report)

    def prepare(ctx: ssl.SSLContext) -> None:
        ctx.sslobject_class = cls

    return prepare


class SwitchingContext(ssl.SSLContext):
    """What the listening socket is given: each accepted connection gets the context in force
    (``current``) at that moment. Only ``wrap_bio`` is ever called on it (by uvloop)."""

    current: ssl.SSLContext

    def __new__(cls, first: ssl.SSLContext) -> SwitchingContext:
        self = super().__new__(cls, ssl.PROTOCOL_TLS_SERVER)
        self.current = first
        return self

    def __init__(self, first: ssl.SSLContext) -> None:
        pass  # ssl.SSLContext.__init__ takes the protocol, already given to __new__

    def install(self, ctx: ssl.SSLContext) -> None:
        """``ctx`` for the connections accepted from now on."""
        self.current = ctx

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        obj = self.current.wrap_bio(
            incoming, outgoing, server_side=server_side, server_hostname=server_hostname
        )
        obj.accepted_at = time.monotonic()  # type: ignore[attr-defined]
        return obj


def accepted_at(obj: ssl.SSLObject) -> float:
    """When a TLS connection was accepted (``time.monotonic()``)."""
    return float(getattr(obj, "accepted_at", time.monotonic()))


def xfcc(der: bytes) -> bytes:
    """``X-Forwarded-Client-Cert`` as Envoy writes it for a client certificate (DER):
    ``Hash=<hex SHA-256 of the DER>;Subject="<RFC 4514 subject>"``, the subject quoted, a
    ``"`` or ``\\`` in it escaped with a backslash, and every byte outside printable ASCII (CR,
    LF, other controls, UTF-8) as ``\\xHH``: a subject is the client's own text, and raw it
    could end the header and start another, or another request. Nothing else of the
    certificate."""
    subject = x509.load_der_x509_certificate(der).subject.rfc4514_string()
    return f'Hash={hashlib.sha256(der).hexdigest()};Subject="{quoted(subject)}"'.encode()


def quoted(text: str) -> str:
    """``text`` safe inside a quoted header value: printable ASCII as is (``"`` and ``\\``
    escaped), every other byte of its UTF-8 as ``\\xHH``."""
    out: list[str] = []
    for byte in text.encode("utf-8", "surrogatepass"):
        if byte in (0x22, 0x5C):
            out.append("\\" + chr(byte))
        elif 0x20 <= byte < 0x7F:
            out.append(chr(byte))
        else:
            out.append(f"\\x{byte:02x}")
    return "".join(out)


SHUTDOWN_TIMEOUT = 2.0  # seconds; nginx does not wait for the peer's close_notify at all


class TlsSite(web.TCPSite):
    """aiohttp's TCP site, its TLS handshake bounded by ``handshake_timeout`` (aiohttp passes
    none: uvloop's default is 60 s)."""

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, *, handshake_timeout: float, **kw: Any
    ) -> None:
        super().__init__(runner, host, port, **kw)
        self._handshake_timeout = handshake_timeout

    async def start(self) -> None:
        self._runner._reg_site(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
            ssl_handshake_timeout=self._handshake_timeout,
            # A connection the sidecar closes (a 408 to a slow head, keep-alive expiry) sends
            # its close_notify and waits this long for the client's before the socket goes:
            # uvloop's 30 s would let a TLS slowloris hold each socket 30 s past its 408.
            ssl_shutdown_timeout=SHUTDOWN_TIMEOUT,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port
