"""How the status page's forms are authenticated, without JavaScript and without the token ever
being in a URL or a page.

- The token is typed by the operator into a password field of the form that carries the
  action, sent in the POST body, compared in constant time and never echoed back. The page
  holds no credential at all: no cookie, no session, nothing a browser sends by itself.
- Because nothing is ambient, a cross-site request cannot borrow the operator's rights. Still,
  each form page carries a one-time nonce (HMAC-signed with a per-process key, valid for an
  hour, refused when used twice) bound to its form's action, so the nonce of the "lift" form
  cannot submit the "set" form; and the admin guard (``origin``) refuses, for every request,
  a ``Host`` nobody configured (DNS rebinding) and a request its browser marks as cross-site.
- With no token configured (the admin listener is then loopback only), the nonce and the
  guard are all there is.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict

NONCE_TTL = 3600.0
MAX_USED = 10_000


class FormRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Nonces:
    """One-time form nonces: ``<issued>.<random>.<hmac>``, the HMAC over the action (the
    form's path) too, so a nonce is good for its own form only. Clock passed in."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)
        self._used: OrderedDict[str, float] = OrderedDict()

    def _mac(self, action: str, body: str) -> str:
        signed = f"{action}\n{body}"  # no action holds a newline
        return hmac.new(self._key, signed.encode(), hashlib.sha256).hexdigest()[:32]

    def issue(self, action: str, wall: float) -> str:
        body = f"{int(wall)}.{secrets.token_urlsafe(12)}"
        return f"{body}.{self._mac(action, body)}"

    def use(self, action: str, nonce: str, wall: float) -> None:
        """Accept a nonce issued for ``action``, once; FormRefused otherwise."""
        body, _, mac = nonce.rpartition(".")
        issued_s, _, _ = body.partition(".")
        if (
            not body
            or not nonce.isascii()  # compare_digest refuses non-ASCII str (a TypeError)
            or not issued_s.isdigit()
            or not hmac.compare_digest(mac, self._mac(action, body))
        ):
            raise FormRefused(
                403, "this form was not issued by this sidecar for this action; reload the page"
            )
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


def check_token(given: str | None, token: str | None) -> None:
    if token is None:
        return
    if not given or not hmac.compare_digest(given.encode(), token.encode()):
        raise FormRefused(401, "the admin token is wrong or missing")
