"""How the status page's forms are authenticated, without JavaScript and without the token ever
being in a URL or a page.

- The token is typed by the operator into a password field of the form that carries the
  action, sent in the POST body, compared in constant time and never echoed back. The page
  holds no credential at all: no cookie, no session, nothing a browser sends by itself.
- Because nothing is ambient, a cross-site request cannot borrow the operator's rights. Still,
  each form page carries a one-time nonce (HMAC-signed with a per-process key, valid for an
  hour, refused when used twice), and a POST whose ``Origin`` (or ``Sec-Fetch-Site``) says it
  came from another site is refused, so a form cannot be posted from anywhere but the page
  that this sidecar rendered.
- With no token configured (the admin listener is then loopback only), the nonce and the
  origin check are all there is; the ``Host`` must then name a loopback address or
  ``localhost``, so a DNS-rebinding page cannot pose as same-origin.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Mapping

from sidecar.admin.auth import is_loopback

NONCE_TTL = 3600.0
MAX_USED = 10_000


class FormRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Nonces:
    """One-time form nonces: ``<issued>.<random>.<hmac>``. Clock passed in."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)
        self._used: OrderedDict[str, float] = OrderedDict()

    def _mac(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()[:32]

    def issue(self, wall: float) -> str:
        body = f"{int(wall)}.{secrets.token_urlsafe(12)}"
        return f"{body}.{self._mac(body)}"

    def use(self, nonce: str, wall: float) -> None:
        """Accept a nonce once; FormRefused otherwise."""
        body, _, mac = nonce.rpartition(".")
        issued_s, _, _ = body.partition(".")
        if (
            not body
            or not nonce.isascii()  # compare_digest refuses non-ASCII str (a TypeError)
            or not issued_s.isdigit()
            or not hmac.compare_digest(mac, self._mac(body))
        ):
            raise FormRefused(403, "this form was not issued by this sidecar; reload the page")
        if not 0 <= wall - int(issued_s) <= NONCE_TTL:
            raise FormRefused(403, "this form has expired; it is filled in again below")
        self._prune(wall)
        if nonce in self._used:
            raise FormRefused(409, "this form was already submitted; nothing was done twice")
        self._used[nonce] = int(issued_s)
        while len(self._used) > MAX_USED:
            self._used.popitem(last=False)

    def _prune(self, wall: float) -> None:
        while self._used:
            nonce, issued = next(iter(self._used.items()))
            if wall - issued <= NONCE_TTL:
                break
            del self._used[nonce]


def host_name(host: str) -> str:
    """The name part of a Host header: ``[::1]:15000`` -> ``::1``, ``a:1`` -> ``a``."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def check_origin(headers: Mapping[str, str], host: str | None, token_set: bool) -> None:
    """Refuse a POST that a browser says came from another site.

    ``Sec-Fetch-Site`` is set by the browser itself (a page cannot forge it), so when present
    it decides. Otherwise ``Origin`` must name this listener; ``Origin: null`` (an opaque or
    privacy-stripped origin) is refused. A client that sends neither (curl, an old browser)
    is judged by the nonce and the token alone.
    """
    site = headers.get("Sec-Fetch-Site")
    origin = headers.get("Origin")
    if site is not None:
        if site not in ("same-origin", "none"):
            raise FormRefused(403, f"cross-site form posts are refused (Sec-Fetch-Site: {site})")
    elif origin is not None and (
        origin == "null" or host is None or origin.lower() != f"http://{host}".lower()
    ):
        raise FormRefused(403, f"cross-site form posts are refused (Origin: {origin})")
    if not token_set and not is_loopback(host_name(host or "")):
        raise FormRefused(
            403, "without an admin token, forms are accepted only on a loopback address"
        )


def check_token(given: str | None, token: str | None) -> None:
    if token is None:
        return
    if not given or not hmac.compare_digest(given.encode(), token.encode()):
        raise FormRefused(401, "the admin token is wrong or missing")
