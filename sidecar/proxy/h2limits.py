"""What an HTTP/2 connection of the listener is held to (``proxy/h2conn.py``): the limits read
from the config when it is accepted, the rates past which its client is told to calm down, and
the ``h2`` connection made with them: our SETTINGS (``http2.max_concurrent_streams``,
``limits.max_header_bytes`` as the header list size, no push), the HPACK decoder bounded by
the same size, a header block's encoded fragments bounded before it is decoded
(``HEADER_BLOCK_FACTOR`` times that size: a CONTINUATION flood holds no more), the HPACK table of
our answers bounded whatever the client advertises (``ENCODER_TABLE``), and a count of the frames
that cost work yet give the request path nothing (``ServerConnection.unpaid``: a frame on a closed
stream, a WINDOW_UPDATE beyond ``WINDOW_UPDATES_PER_DATA`` per DATA frame sent), which the
connection holds to the control-frame rate. A GOAWAY of our own is written with ``hyperframe``
(``h2``'s own ends the connection to every frame, the answers of the streams in flight
included)."""

from __future__ import annotations

from typing import Any, Final

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import Event
from h2.exceptions import DenialOfServiceError
from h2.frame_buffer import FrameBuffer
from h2.settings import SettingCodes, Settings
from hpack import Encoder
from hyperframe.frame import Frame, GoAwayFrame, WindowUpdateFrame

from sidecar import h2quiet
from sidecar.config.model import Config

h2quiet.quiet()  # h2 and hpack without their per-frame debug work

RESET_BURST_MIN = 200  # streams reset at once before the rate applies (or 2x the stream limit)
RESET_RATE = 100.0  # streams reset a second, sustained
CONTROL_BURST = 200  # SETTINGS / PING / PRIORITY / unknown / empty DATA frames at once
CONTROL_RATE = 100.0  # a second, sustained
LINGER = 2.0  # seconds a connection closed for an error reads and drops what still comes
_NO_LIMIT = 2**31  # h2's own stream check (a connection error) kept out of the way
# A header block's encoded bytes per byte of the list it may decode to: HPACK's longest Huffman
# code is 30 bits (3.75 bytes for one), so a block past 4x the list size cannot fit in it.
HEADER_BLOCK_FACTOR = 4
ENCODER_TABLE = 4096  # our answers' HPACK table at most (nghttp2's default for its encoder)
WINDOW_UPDATES_PER_DATA = 10  # WINDOW_UPDATEs a DATA frame we send pays for (Envoy's default)
_WINDOW_CREDIT_MAX = 2000  # what a client may bank of that


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


class _HeaderBlockBuffer(FrameBuffer):
    """``h2``'s frame buffer, a header block's fragments held to ``limit`` encoded bytes (``h2``
    alone bounds only their number, 64, so up to 1 MiB a connection)."""

    def __init__(self, limit: int) -> None:
        super().__init__(server=True)
        self._limit = limit

    def _update_header_buffer(self, f: Frame | None) -> Frame | None:
        out = super()._update_header_buffer(f)
        if sum(len(x.data) for x in self._headers_buffer) > self._limit:
            raise DenialOfServiceError("a header block larger than the header list size allows")
        return out


class _BoundedEncoder(Encoder):
    """The HPACK encoder of our answers, its table never above ``ENCODER_TABLE`` bytes: a
    client advertising a huge SETTINGS_HEADER_TABLE_SIZE would otherwise have every distinct
    answer field kept (and searched) for the connection's life."""

    @property
    def header_table_size(self) -> int:
        return int(self.header_table.maxsize)

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        self.header_table.maxsize = value = min(value, ENCODER_TABLE)
        if self.header_table.resized:
            self.table_size_changes.append(value)


class ServerConnection(H2Connection):
    """``h2``'s connection, counting in ``unpaid`` the frames that cost work and gave the request
    path nothing: those ``h2`` handles without an event (DATA, WINDOW_UPDATE, RST_STREAM on a
    closed stream: each may make us send a RST_STREAM) and WINDOW_UPDATEs beyond
    ``WINDOW_UPDATES_PER_DATA`` for each DATA frame we sent."""

    def __init__(self, config: H2Configuration, header_block: int) -> None:
        super().__init__(config)
        self.incoming_buffer = _HeaderBlockBuffer(header_block)
        self.encoder = _BoundedEncoder()
        self.unpaid = 0
        self._credit = 0

    def take_unpaid(self) -> int:
        unpaid, self.unpaid = self.unpaid, 0
        return unpaid

    def send_data(
        self, stream_id: int, data: Any, end_stream: bool = False, pad_length: Any = None
    ) -> None:
        super().send_data(stream_id, data, end_stream, pad_length)
        self._credit = min(_WINDOW_CREDIT_MAX, self._credit + WINDOW_UPDATES_PER_DATA)

    def _receive_frame(self, frame: Frame) -> list[Event]:
        events = super()._receive_frame(frame)
        if not events:
            self.unpaid += 1
        elif isinstance(frame, WindowUpdateFrame):
            if self._credit > 0:
                self._credit -= 1
            else:
                self.unpaid += 1
        return events


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


def server_connection(limits: H2Limits) -> ServerConnection:
    """The server side's ``h2`` state machine, our settings in it (see the module docstring).
    Inbound fields are checked by ``h2fields.map_request`` (a stream error), not by ``h2``
    (which would end the connection)."""
    config = H2Configuration(
        client_side=False, header_encoding=None, validate_inbound_headers=False
    )
    block = max(HEADER_BLOCK_FACTOR * limits.header_bytes, 16384)  # at least one frame's worth
    conn = ServerConnection(config, block)
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
