"""The states of one upstream connection, in the style of h11. Pure: no I/O.

An HTTP/1.1 exchange has two sides that move on their own: the request we send and the
response the upstream sends. An upstream may answer before the request body is all sent (a 413
or 401 to a streamed upload: the "early answer"), so one linear state cannot describe both.
Like h11, each side has its own small machine, and the connection as a whole has a third one
saying whether it can still carry another exchange.

    request   IDLE -> SENDING -> SENT
                      SENDING -> ABANDONED        (an early answer stopped the upload)
    response  IDLE -> AWAITING_HEAD -> BODY -> DONE
                      AWAITING_HEAD -> DONE       (no body: HEAD, 204, 304, Content-Length 0)
    link      OPEN -> MUST_CLOSE -> CLOSED        (the exchange may end, but never reuse)
              OPEN | MUST_CLOSE -> BROKEN -> CLOSED   (the exchange failed)
              OPEN -> CLOSED

The response side starts (IDLE -> AWAITING_HEAD) together with the request, since a response
can begin while the request is still being written. A connection goes back to the pool only
when both sides ended cleanly (SENT and DONE) and the link is still OPEN; ``next_exchange``
then puts both sides back to IDLE. Every move not listed raises ``IllegalConnTransition``: a bug,
never a state quietly reached.
"""

from __future__ import annotations

from enum import Enum


class IllegalConnTransition(Exception):  # not RuntimeError: mypyc compiles this module
    """A move the state machine does not allow (a bug in the caller)."""


class _State(Enum):
    # Members are singletons: hash by identity (C speed) instead of Enum's Python-level hash
    # of the name; the transition tables are looked up several times per exchange.
    __hash__ = object.__hash__


class Req(_State):
    IDLE = "idle"
    SENDING = "sending"
    SENT = "sent"
    ABANDONED = "abandoned"


class Resp(_State):
    IDLE = "idle"
    AWAITING_HEAD = "awaiting-head"
    BODY = "body"
    DONE = "done"


class Link(_State):
    OPEN = "open"
    MUST_CLOSE = "must-close"
    BROKEN = "broken"
    CLOSED = "closed"


_REQ: dict[Req, frozenset[Req]] = {
    Req.IDLE: frozenset({Req.SENDING}),
    Req.SENDING: frozenset({Req.SENT, Req.ABANDONED}),
    Req.SENT: frozenset(),
    Req.ABANDONED: frozenset(),
}
_RESP: dict[Resp, frozenset[Resp]] = {
    Resp.IDLE: frozenset({Resp.AWAITING_HEAD}),
    Resp.AWAITING_HEAD: frozenset({Resp.BODY, Resp.DONE}),
    Resp.BODY: frozenset({Resp.DONE}),
    Resp.DONE: frozenset(),
}
_LINK: dict[Link, frozenset[Link]] = {
    Link.OPEN: frozenset({Link.MUST_CLOSE, Link.BROKEN, Link.CLOSED}),
    Link.MUST_CLOSE: frozenset({Link.BROKEN, Link.CLOSED}),
    Link.BROKEN: frozenset({Link.CLOSED}),
    Link.CLOSED: frozenset(),
}


class ConnState:
    """The three machines of one connection. Only these methods change them."""

    __slots__ = ("link", "req", "resp")

    def __init__(self) -> None:
        self.req = Req.IDLE
        self.resp = Resp.IDLE
        self.link = Link.OPEN

    def __repr__(self) -> str:
        return f"<ConnState req={self.req.value} resp={self.resp.value} link={self.link.value}>"

    def request(self, to: Req) -> None:
        if to not in _REQ[self.req]:
            raise IllegalConnTransition(f"request {self.req.value} -> {to.value}")
        if self.link is not Link.OPEN and to is Req.SENDING:
            raise IllegalConnTransition(f"cannot send on a {self.link.value} connection")
        self.req = to

    def response(self, to: Resp) -> None:
        if to not in _RESP[self.resp]:
            raise IllegalConnTransition(f"response {self.resp.value} -> {to.value}")
        self.resp = to

    def to_link(self, to: Link) -> None:
        """Move the link on; moving to where it already is, or back up, is ignored only for
        the terminal ends (closing twice, or breaking what is already broken or closed)."""
        if to is self.link and to in (Link.CLOSED, Link.BROKEN, Link.MUST_CLOSE):
            return
        if to is Link.BROKEN and self.link is Link.CLOSED:
            return
        if to is Link.MUST_CLOSE and self.link in (Link.BROKEN, Link.CLOSED):
            return
        if to not in _LINK[self.link]:
            raise IllegalConnTransition(f"link {self.link.value} -> {to.value}")
        self.link = to

    def begin(self) -> None:
        """A new exchange starts on this connection: IDLE -> SENDING and IDLE ->
        AWAITING_HEAD, on an OPEN link only."""
        if self.req is not Req.IDLE or self.resp is not Resp.IDLE:
            raise IllegalConnTransition(f"exchange begun on a busy connection {self!r}")
        if self.link is not Link.OPEN:
            raise IllegalConnTransition(f"cannot send on a {self.link.value} connection")
        self.req = Req.SENDING
        self.resp = Resp.AWAITING_HEAD

    @property
    def reusable(self) -> bool:
        return self.req is Req.SENT and self.resp is Resp.DONE and self.link is Link.OPEN

    def next_exchange(self) -> None:
        """Both sides ended cleanly: the connection may carry another exchange."""
        if not self.reusable:
            raise IllegalConnTransition(f"connection not reusable: {self!r}")
        self.req = Req.IDLE
        self.resp = Resp.IDLE
