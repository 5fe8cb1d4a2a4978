"""TLS to ``https://`` upstreams: one client context per distinct route ``tls:`` section, the
TLS sessions it may resume, and what a failed handshake is.

Python's ``ssl`` module (OpenSSL) does all of TLS, under the loop's own TLS transport
(``create_connection(ssl=...)``): no TLS code of ours. The contexts are built from the config
(``config/tls.py``'s ``client_context``) when a config is applied, never on the request path,
and kept by the section's value: a reload that leaves a route's ``tls:`` as it was keeps its
context (and its sessions), one that changes it builds a new one, and the pools of a context
no route uses any more are closed (``UpstreamClient.sync_tls``).

Session resumption: neither asyncio nor uvloop takes a session in ``create_connection``, but
both make the handshake's ``SSLObject`` with the context's ``wrap_bio``. The context built
here answers ``wrap_bio`` with the last session its server name gave (a ticket from a previous
connection), which OpenSSL offers in the ClientHello; a server that takes it skips the full
handshake (no certificate sent, no key exchange signed). A session is kept once per
connection, after its first exchange (a TLS 1.3 server sends its tickets after the handshake).

A failed handshake: a certificate the sidecar refuses (``ssl.SSLCertVerificationError``:
unknown CA, wrong name, expired) is ``TlsCertificateError``; an alert from the server, or bytes
that are no TLS, ``TlsHandshakeError``; a timeout, a reset or a refused connect stays a connect
failure (no byte of the request was sent: retried for any method).
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable
from typing import Any

from sidecar import outcomes
from sidecar.config.model import Config
from sidecar.config.tls import RouteTls, client_context
from sidecar.core import TlsCertificateError, TlsHandshakeError, UpstreamError

log = logging.getLogger("sidecar.upstream")

# The handshakes_total result of a handshake that worked (the others are row names).
OK = "ok"
HANDSHAKE_RESULTS = (
    OK,
    outcomes.TLS_CERTIFICATE.name,
    outcomes.TLS_HANDSHAKE.name,
    outcomes.CONNECT_FAILURE.name,
)
Report = Callable[[str], None]
LOG_EVERY = 10.0  # seconds between two log lines of the same refusal of the same name


def _alert(reason: str | None) -> bool:
    """OpenSSL names the alerts a peer sent ``SSLV3_ALERT_*``, ``TLSV1_ALERT_*``,
    ``TLSV13_ALERT_*`` and a few ``TLSV1_*`` (unrecognized_name ...)."""
    return reason is not None and reason.startswith(("SSLV3_ALERT", "TLSV1"))


def handshake_error(exc: BaseException, where: str) -> UpstreamError | None:
    """The project's error for a handshake that failed with ``exc``; None when it is not a
    TLS refusal (a reset, a timeout: the caller's connect failure)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        reason = exc.verify_message or exc.reason or str(exc)
        return TlsCertificateError(f"TLS certificate of {where} refused: {reason}")
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)):
        return None  # the peer went away mid-handshake: transient
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or str(exc)
        if _alert(exc.reason):
            return TlsHandshakeError(f"TLS alert from {where}: {reason}")
        return TlsHandshakeError(f"no TLS handshake with {where}: {reason}", "tls_protocol_error")
    return None


def alert_after_handshake(exc: BaseException | None, target: TlsTarget) -> UpstreamError | None:
    """A TLS 1.3 server checks the client's certificate after the client's side of the
    handshake is done: its refusal (an alert) arrives in place of the first response. Logged
    and counted as the handshake's result (the client's side of it was counted ok)."""
    if isinstance(exc, ssl.SSLError) and _alert(exc.reason):
        err = TlsHandshakeError(f"TLS alert from {target.server_name}: {exc.reason}")
        target.report(err.code, err)
        return err
    return None


def tls_sections(config: Config) -> list[RouteTls]:
    """The ``tls:`` values of the routes that have an ``https://`` upstream."""
    return [r.tls for r in config.routes if any(u.tls for u in r.upstreams)]


class TlsTarget:
    """What a pool needs to speak TLS to one endpoint: the route's context and the name sent
    as SNI and verified (never the address). One per (context, name): a pool's identity."""

    __slots__ = ("context", "server_name")

    def __init__(self, context: RouteContext, server_name: str) -> None:
        self.context = context
        self.server_name = server_name

    @property
    def ssl(self) -> ssl.SSLContext:
        return self.context.ssl

    def report(self, result: str, exc: UpstreamError | None = None) -> None:
        self.context.report(result, self.server_name, exc)

    def keep_session(self, ssl_object: object) -> None:
        self.context.keep_session(self.server_name, ssl_object)


class RouteContext:
    """The client context of one ``tls:`` value, its targets by name and their sessions."""

    def __init__(self, tls: RouteTls, report: Report) -> None:
        self.tls = tls
        self.stamp = stamp(tls)  # its files as they were read
        self.ssl = client_context(tls)
        self._report = report
        self._targets: dict[str, TlsTarget] = {}
        self._sessions: dict[str, ssl.SSLSession] = {}
        self._logged: dict[tuple[str, str], float] = {}
        self._alpn: dict[tuple[str, ...], ssl.SSLContext] = {}
        wrap = self.ssl.wrap_bio
        sessions = self._sessions

        def wrap_bio(
            incoming: ssl.MemoryBIO,
            outgoing: ssl.MemoryBIO,
            server_side: bool = False,
            server_hostname: str | bytes | None = None,
            session: ssl.SSLSession | None = None,
        ) -> ssl.SSLObject:
            if session is None and isinstance(server_hostname, str):
                session = sessions.get(server_hostname)
            return wrap(incoming, outgoing, server_side, server_hostname, session)

        self.ssl.wrap_bio = wrap_bio  # type: ignore[method-assign]

    def alpn_ssl(self, protocols: tuple[str, ...]) -> ssl.SSLContext:
        """A context like ``ssl`` that offers ``protocols`` by ALPN (HTTP/2 upstreams): one of
        its own, so that the HTTP/1.1 pools' context never offers h2."""
        ctx = self._alpn.get(protocols)
        if ctx is None:
            ctx = self._alpn[protocols] = client_context(self.tls)
            ctx.set_alpn_protocols(list(protocols))
        return ctx

    def target(self, host: str) -> TlsTarget:
        """The target for an endpoint of URL host ``host``: SNI and the name verified are the
        section's ``server_name`` or that host."""
        name = self.tls.server_name or host
        t = self._targets.get(name)
        if t is None:
            t = self._targets[name] = TlsTarget(self, name)
        return t

    def targets(self) -> list[TlsTarget]:
        return list(self._targets.values())

    def keep_session(self, name: str, ssl_object: object) -> None:
        session: Any = getattr(ssl_object, "session", None)
        if isinstance(session, ssl.SSLSession):
            self._sessions[name] = session

    def report(self, result: str, name: str, exc: UpstreamError | None) -> None:
        self._report(result)
        if exc is None or result == outcomes.CONNECT_FAILURE.name:
            return
        now = time.monotonic()
        key = (name, str(exc))
        if now - self._logged.get(key, -LOG_EVERY) >= LOG_EVERY:
            self._logged[key] = now
            if len(self._logged) > 1000:
                self._logged.clear()
            log.warning("%s (%s)", exc, exc.code)


def stamp(tls: RouteTls) -> tuple[tuple[int, int], ...]:
    """The files of a section as they are now (a file rewritten has another stamp)."""
    out = []
    for path in (tls.ca_file, tls.client_cert, tls.client_key):
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        out.append((st.st_mtime_ns, st.st_size) if st is not None else (0, 0))
    return tuple(out)


class TlsContexts:
    """The contexts by ``tls:`` value, built when a config is applied (``sync``)."""

    def __init__(self, report: Report = lambda result: None) -> None:
        self.report = report
        self._by_value: dict[RouteTls, RouteContext] = {}

    def sync(self, sections: list[RouteTls]) -> list[RouteContext]:
        """Build the contexts of values not seen before, and of those whose files changed
        on disk (a rotated CA bundle or client certificate, picked up by a reload); raises as
        ``client_context`` on a file gone bad since it was checked, and nothing is changed
        then. Returns the contexts no section uses any more (or replaced), dropped."""
        built: dict[RouteTls, RouteContext] = {}
        for t in sections:
            c = self._by_value.get(t)
            built[t] = c if c is not None and c.stamp == stamp(t) else RouteContext(t, self.report)
        gone = [c for t, c in self._by_value.items() if built.get(t) is not c]
        self._by_value = built
        return gone

    def get(self, tls: RouteTls) -> RouteContext:
        c = self._by_value.get(tls)
        if c is None:  # a section applied without sync (a test's own client)
            c = self._by_value[tls] = RouteContext(tls, self.report)
        return c
