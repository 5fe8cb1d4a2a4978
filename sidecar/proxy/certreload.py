"""The listener's certificate and key re-read when they change on disk, without a restart.

cert-manager and Kubernetes Secret volumes rotate a pair by swapping a symlink (``..data`` ->
a new timestamped directory, the files links through it), so both files change at once; a
hand copy may write one file, then the other, or write a file in place. The ``tls-reload``
task polls the files' identity (``os.stat`` through the links: device, inode, size, mtime)
every ``POLL`` seconds. A change is loaded once the files stood still for one poll
(``step``, pure), as a new ``ssl.SSLContext`` from the files as they are then
(``config.tls.server_context``): a pair that loads and matches goes in force for the next
handshake (``tlslisten.SwitchingContext``); open connections keep theirs. A pair that does
not (a file missing, half written, a key of another certificate) is refused once per change
with a warning and ``retry_sidecar_tls_reloads_total{result}``, and the pair in force keeps
serving. The client CA file (``client_ca_file``) is watched and re-read the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from sidecar.config.tls import CertInfo, ServerTls, cert_info, server_context, utc_text
from sidecar.proxy.tlslisten import ALPN

log = logging.getLogger("sidecar.tls")

POLL = 0.5  # seconds between two looks at the files: a change is in force within 2 polls
EXPIRY_WARNING = 14 * 86400.0  # a warning at start when the certificate expires sooner

# retry_sidecar_tls_reloads_total{result}
LOADED = "ok"
MISSING = "missing"  # a file is not there (or a link points nowhere)
INVALID = "invalid"  # a file does not parse: half written, not PEM
MISMATCH = "mismatch"  # the key is not the certificate's
EXPIRED = (
    "expired"  # the new certificate has expired (or is not valid yet): every client would refuse it
)
RELOAD_RESULTS = (LOADED, MISSING, INVALID, MISMATCH, EXPIRED)


class NotValidNow(ValueError):
    """A new certificate outside its validity period: kept out, the pair in force serves on."""


FileId = tuple[int, int, int, int] | None  # (device, inode, size, mtime ns); None: missing


@dataclass(frozen=True, slots=True)
class Stamp:
    """The identity of the watched files (certificate, key, client CA) at one look."""

    files: tuple[FileId, ...]

    @property
    def missing(self) -> bool:
        return any(f is None for f in self.files)


class Step(Enum):
    SAME = "same"  # nothing new: the pair in force, or a change already refused
    SETTLING = "settling"  # changed since the last look: looked at again next poll
    LOAD = "load"  # changed, and still since the last look: load it now


def step(in_force: Stamp, refused: Stamp | None, last: Stamp | None, now: Stamp) -> Step:
    """What to do with the files as they are ``now``, given those in force, the last change
    refused and the previous look."""
    if now in (in_force, refused):
        return Step.SAME
    if now != last:
        return Step.SETTLING
    return Step.LOAD


def _file_id(path: str) -> FileId:
    try:
        st = os.stat(path)  # through the symlinks: the swap of ..data changes it
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def stamp_of(tls: ServerTls) -> Stamp:
    paths = (tls.cert_file, tls.key_file, tls.client_ca_file)
    return Stamp(tuple(_file_id(p) for p in paths if p is not None))


def load_result(exc: BaseException) -> str:
    """The ``result`` label of a pair refused with ``exc``."""
    if isinstance(exc, FileNotFoundError):
        return MISSING
    if isinstance(exc, NotValidNow):
        return EXPIRED
    if isinstance(exc, ssl.SSLError) and exc.reason == "KEY_VALUES_MISMATCH":
        return MISMATCH
    return INVALID


@dataclass(frozen=True, slots=True)
class ListenerCerts:
    """What the listener presents and trusts now, as ``GET /status`` and the page show it."""

    cert: CertInfo
    client_ca: CertInfo | None
    loaded_at: float  # wall clock
    last_refused: str | None  # the last change refused since, with its reason

    def as_json(self, now: float) -> dict[str, object]:
        def one(c: CertInfo) -> dict[str, object]:
            return {
                "path": c.path,
                "subject": c.subject,
                "issuer": c.issuer,
                "not_after": utc_text(c.not_after),
                "expires_in": c.seconds_left(now),
                "sha256": c.sha256,
            }

        return {
            "cert": one(self.cert),
            "client_ca": one(self.client_ca) if self.client_ca is not None else None,
            "loaded_at": self.loaded_at,
            "last_refused": self.last_refused,
        }


class CertReloader:
    """Owns the listener's context in force and the ``tls-reload`` task's loop."""

    def __init__(
        self,
        tls: ServerTls,
        *,
        wall: Callable[[], float],
        reloaded: Callable[[str], None],
        expiry: Callable[[float], None],
        prepare: Callable[[ssl.SSLContext], None] = lambda ctx: None,
    ) -> None:
        self.tls = tls
        self._wall = wall
        self._reloaded = reloaded  # counts retry_sidecar_tls_reloads_total{result}
        self._expiry = expiry  # sets retry_sidecar_tls_cert_expiry_seconds{use="listener"}
        self._prepare = prepare  # the listener's own settings on each new context
        self._last: Stamp | None = None
        self._refused: Stamp | None = None
        # The first load: a start with files that do not load fails (validate checked them).
        self._in_force = stamp_of(tls)
        self.context = self._build()
        self.certs = self._describe(None)
        self.publish()

    def _build(self) -> ssl.SSLContext:
        ctx = server_context(self.tls, ALPN)
        self._prepare(ctx)
        return ctx

    def _describe(self, refused: str | None) -> ListenerCerts:
        assert self.tls.cert_file is not None
        ca = self.tls.client_ca_file
        return ListenerCerts(
            cert_info(self.tls.cert_file),
            cert_info(ca) if ca is not None else None,
            self._wall(),
            refused,
        )

    def publish(self) -> None:
        """The expiry gauge from the certificate in force, at the wall clock now."""
        self._expiry(self.certs.cert.seconds_left(self._wall()))

    def expiry_warning(self) -> str | None:
        left = self.certs.cert.seconds_left(self._wall())
        if left >= EXPIRY_WARNING:
            return None
        if left < 0:
            return f"the listener certificate {self.certs.cert.path} expired at " + utc_text(
                self.certs.cert.not_after
            )
        return (
            f"the listener certificate {self.certs.cert.path} expires in "
            f"{left / 86400:.1f} days ({utc_text(self.certs.cert.not_after)})"
        )

    def poll(self) -> ssl.SSLContext | None:
        """One look at the files: the new context when a changed pair was loaded, else None."""
        now = stamp_of(self.tls)
        what = step(self._in_force, self._refused, self._last, now)
        self._last = now
        if what is not Step.LOAD:
            return None
        try:
            if now.missing:
                raise FileNotFoundError("a file of the pair is missing")
            ctx = self._build()
            certs = self._describe(None)
            now_wall = self._wall()
            if certs.cert.seconds_left(now_wall) <= 0 or certs.cert.not_before > now_wall:
                raise NotValidNow(
                    f"{certs.cert.path} is valid from {utc_text(certs.cert.not_before)} to "
                    f"{utc_text(certs.cert.not_after)}, not now"
                )
        except (OSError, ValueError, ssl.SSLError) as e:
            self._refused = now
            result = load_result(e)
            self._reloaded(result)
            self.certs = _with_refused(self.certs, f"{result}: {e}")
            log.warning(
                "the listener's new certificate files were refused (%s: %s); the pair in "
                "force keeps serving",
                result,
                e,
            )
            return None
        self._in_force, self._refused = now, None
        self.context, self.certs = ctx, certs
        self._reloaded(LOADED)
        self.publish()
        log.info(
            "the listener's certificate was reloaded: %s, expires %s (sha256 %s)",
            certs.cert.subject,
            utc_text(certs.cert.not_after),
            certs.cert.sha256[:16],
        )
        soon = self.expiry_warning()
        if soon is not None:
            log.warning("%s: renew it", soon)
        return ctx

    async def watch(self, install: Callable[[ssl.SSLContext], None]) -> None:
        """The ``tls-reload`` task: poll forever, ``install`` each new context. On the loop:
        three ``stat`` calls a poll (a Secret volume is tmpfs), a load only on a change."""
        while True:
            await asyncio.sleep(POLL)
            ctx = self.poll()
            if ctx is not None:
                install(ctx)
            self.publish()


def _with_refused(certs: ListenerCerts, why: str) -> ListenerCerts:
    return ListenerCerts(certs.cert, certs.client_ca, certs.loaded_at, why)
