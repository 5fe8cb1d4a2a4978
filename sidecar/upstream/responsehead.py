"""What an upstream response head says, judged as nginx and RFC 9110/9112 want it: its bounds,
a valid final status, and the one pass over its fields that finds the framing (a length,
``chunked``, or the close) and the two fields the retry engine reads. Pure: no I/O."""

from __future__ import annotations

from sidecar.core import BadResponse

MAX_RESPONSE_HEAD = 64 * 1024
MAX_RESPONSE_HEADERS = 200
MAX_INTERIM = 8  # 1xx responses before the final one; more is a misbehaving upstream

Headers = list[tuple[bytes, bytes]]


class HeadFields:
    """The framing and the retry engine's fields of one final response head."""

    __slots__ = ("content_length", "framed", "proxy_error", "retry_after")

    def __init__(
        self,
        framed: bool,
        content_length: int | None,
        retry_after: bytes | None,
        proxy_error: bytes | None,
    ) -> None:
        self.framed = framed  # a length or chunked: else the body ends with the connection
        self.content_length = content_length  # announced (not chunked)
        self.retry_after = retry_after
        self.proxy_error = proxy_error  # x-retry-proxy-error of an inner sidecar


def check_field(head_bytes: int, fields: int) -> None:
    """A head of ``head_bytes`` with ``fields`` fields so far may take one more."""
    if head_bytes > MAX_RESPONSE_HEAD or fields >= MAX_RESPONSE_HEADERS:
        raise BadResponse(
            f"response head over {MAX_RESPONSE_HEAD} bytes or {MAX_RESPONSE_HEADERS} fields",
            "http_response_header_section_size",
        )


def check_final_status(status: int) -> None:
    # RFC 9110 section 15: values outside 100-599 are invalid; a client must treat them as a
    # 5xx. Relaying "HTTP/1.1 0" would break clients.
    if status > 599 or status < 100:
        raise BadResponse(f"invalid status code {status}", "http_protocol_error")


def read_fields(headers: Headers) -> HeadFields:
    """One pass over the fields, noted for framing and for the retry engine."""
    framed = chunked = False
    length: int | None = None
    retry_after = proxy_error = None
    for name, value in headers:
        n = len(name)  # compare lengths first: lower-casing every name costs
        if n == 11 and retry_after is None and name.lower() == b"retry-after":
            retry_after = value
            continue
        if n == 19 and proxy_error is None and name.lower() == b"x-retry-proxy-error":
            proxy_error = value
            continue
        if n == 17 and name.lower() == b"transfer-encoding":
            codings = [c.strip().lower() for c in value.split(b",") if c.strip()]
            if codings != [b"chunked"]:
                # nginx (1.23+) and Envoy refuse these too: relaying the body without its
                # coding would hand the client bytes it cannot decode.
                raise BadResponse(
                    f"unsupported transfer coding {value[:40]!r}",
                    "http_response_transfer_coding",
                )
            framed = chunked = True
        elif n == 14 and name.lower() == b"content-length":
            framed = True
            v = value.strip()
            length = int(v) if v.isdigit() else None
    return HeadFields(framed, None if chunked else length, retry_after, proxy_error)
