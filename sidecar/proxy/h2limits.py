"""What an HTTP/2 connection of the listener is held to (``proxy/h2conn.py``): the limits read
from the config when it is accepted, the rates past which its client is told to calm down, and
the ``h2`` connection made with them: our SETTINGS (``http2.max_concurrent_streams``,
``limits.max_header_bytes`` as the header list size, no push) and the HPACK decoder bounded by
the same size. A GOAWAY of our own is written with ``hyperframe`` (``h2``'s own ends the
connection to every frame, the answers of the streams in flight included)."""

from __future__ import annotations

from typing import Final

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.settings import SettingCodes, Settings
from hyperframe.frame import GoAwayFrame

from sidecar.config.model import Config

RESET_BURST_MIN = 200  # streams reset at once before the rate applies (or 2x the stream limit)
RESET_RATE = 100.0  # streams reset a second, sustained
CONTROL_BURST = 200  # SETTINGS / PING / PRIORITY / unknown / empty DATA frames at once
CONTROL_RATE = 100.0  # a second, sustained
LINGER = 2.0  # seconds a connection closed for an error reads and drops what still comes
_NO_LIMIT = 2**31  # h2's own stream check (a connection error) kept out of the way


class H2Limits:
    """What a connection is held to, read from the config when it is accepted."""

    __slots__ = ("header_bytes", "header_timeout", "idle", "send_timeout", "streams")

    def __init__(
        self,
        streams: int,
        header_bytes: int,
        send_timeout: float,
        idle: float,
        header_timeout: float = 10.0,
    ) -> None:
        self.streams: Final = streams
        self.header_bytes: Final = header_bytes
        self.send_timeout: Final = send_timeout
        self.idle: Final = idle
        # the first request's headers are due this long after the connection was handed over
        self.header_timeout: Final = header_timeout


class _LocalSettings(Settings):
    """Our settings as advertised; ``h2``'s own check of the stream limit (a connection error
    PROTOCOL_ERROR) never fires: the connection refuses a stream over it with REFUSED_STREAM."""

    @property
    def max_concurrent_streams(self) -> int:
        return _NO_LIMIT

    @max_concurrent_streams.setter
    def max_concurrent_streams(self, value: int) -> None:
        self[SettingCodes.MAX_CONCURRENT_STREAMS] = value


def limits_of(config: Config) -> H2Limits:
    """What a connection accepted now is held to (the config in force)."""
    limits = config.limits
    return H2Limits(
        config.http2.max_concurrent_streams,
        limits.max_header_bytes,
        limits.send_timeout,
        limits.keepalive_timeout,
        limits.header_timeout,
    )


def server_connection(limits: H2Limits) -> H2Connection:
    """The server side's ``h2`` state machine, our settings in it (see the module docstring).
    Inbound fields are checked by ``h2fields.map_request`` (a stream error), not by ``h2``
    (which would end the connection)."""
    config = H2Configuration(
        client_side=False, header_encoding=None, validate_inbound_headers=False
    )
    conn = H2Connection(config)
    conn.local_settings = _LocalSettings(
        client=False,
        initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: limits.streams,
            SettingCodes.MAX_HEADER_LIST_SIZE: limits.header_bytes,
            SettingCodes.ENABLE_PUSH: 0,
        },
    )
    conn.decoder.max_header_list_size = limits.header_bytes
    return conn


def goaway(last_stream_id: int, code: ErrorCodes) -> bytes:
    frame = GoAwayFrame(0)
    frame.last_stream_id = last_stream_id
    frame.error_code = code
    return bytes(frame.serialize())
