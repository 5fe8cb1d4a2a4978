"""HTTP/2 attacks found by probing the listener from outside, each against the real sidecar
process (uvloop, as shipped) and a raw client on the ``h2`` package: frames that cost work and
carry nothing (WINDOW_UPDATE floods, frames on a stream already reset, streams the sidecar
itself must refuse), a header block's fragments held past what its list may decode to, the
HPACK table of our answers sized by the client, and an absolute-form ``:path``."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated, DataReceived, RemoteSettingsChanged, StreamReset
from h2.settings import SettingCodes
from hpack import Encoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    WindowUpdateFrame,
)

from tests.proc import free_port, launched
from tests.proxy.test_http2 import RawH2, ended, rss_kib, sidecar, status_of, terminated, upstream


def _calmed(client: RawH2, event: object) -> None:
    assert isinstance(event, ConnectionTerminated), client.events[-5:]
    assert event.error_code == ErrorCodes.ENHANCE_YOUR_CALM


async def test_a_window_update_flood_ends_the_connection(tmp_path: Path) -> None:
    """WINDOW_UPDATEs no DATA frame paid for are control frames: 5,000 of them (each made the
    sidecar walk its streams) end the connection, where they were read for ever. A client that
    opens its windows as a 2 MB answer arrives, frame by frame, is served."""
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, proc):
        polite = await RawH2(port).open()
        polite.request(1, "/big?n=2000000")
        got = 0
        while True:
            event = await polite.until(lambda e: isinstance(e, (DataReceived, StreamReset)))
            assert isinstance(event, DataReceived), event
            polite.events.remove(event)
            got += len(event.data or b"")
            polite.conn.acknowledge_received_data(event.flow_controlled_length or 0, 1)
            polite.flush()  # a WINDOW_UPDATE for the stream and one for the connection each
            if event.stream_ended is not None:
                break
        assert got == 2_000_000
        polite.close()
        before = rss_kib(proc)
        client = await RawH2(port).open()
        client.raw(WindowUpdateFrame(0, window_increment=1).serialize() * 5000)
        _calmed(client, await client.until(terminated))
        assert rss_kib(proc) - before < 40_000


async def test_frames_on_a_stream_the_sidecar_reset_are_held_to_the_control_rate(
    tmp_path: Path,
) -> None:
    """DATA on a stream the sidecar refused gave no event and was answered with a RST_STREAM
    each, read for ever: now 5,000 of them end the connection with ENHANCE_YOUR_CALM."""
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        client = await RawH2(port).open()
        client.conn.config.validate_outbound_headers = False
        client.conn.config.normalize_outbound_headers = False
        client.request(1, "/m", end=False, extra=[(b"connection", b"close")])
        reset = await client.until(ended(1))
        assert isinstance(reset, StreamReset)
        empty = DataFrame(1)
        empty.data = b""
        client.raw(empty.serialize() * 5000)
        _calmed(client, await client.until(terminated))
        assert up.paths == []


async def test_streams_the_sidecar_refuses_count_as_resets(tmp_path: Path) -> None:
    """Malformed requests, each refused with RST_STREAM PROTOCOL_ERROR, cost the sidecar work
    as streams its client resets do: 3,000 of them end the connection (they were served, one
    after another, for as long as they came, the admin API waiting meanwhile)."""
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        client = await RawH2(port).open()
        encoder = Encoder()
        frames = []
        for i in range(3000):
            head = HeadersFrame(1 + 2 * i, flags=["END_HEADERS", "END_STREAM"])
            fields = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/m")]
            head.data = encoder.encode([*fields, (b"connection", b"close")])
            frames.append(head.serialize())
        client.raw(b"".join(frames))
        # Read as frames: the client's own state machine knows none of these streams.
        assert client._reader is not None
        wire = b""
        async with asyncio.timeout(10):
            while chunk := await client._reader.read(65536):
                wire += chunk
        goaways = []
        while len(wire) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(wire[:9]))
            frame.parse_body(memoryview(wire[9 : 9 + length]))
            wire = wire[9 + length :]
            if isinstance(frame, GoAwayFrame):
                goaways.append(frame.error_code)
        assert goaways == [ErrorCodes.ENHANCE_YOUR_CALM]
        assert up.paths == []
        client.close()


async def test_a_header_block_larger_than_its_list_may_be_ends_the_connection(
    tmp_path: Path,
) -> None:
    """A header block's fragments were held until 64 CONTINUATION frames (up to 1 MiB a
    connection, for the whole head deadline); a block past 4x limits.max_header_bytes (HPACK's
    longest code is 30 bits: no list within the limit encodes larger) now ends it at once."""
    top = "limits: {max_header_bytes: 8KiB, header_timeout: 30s}\n"
    async with upstream() as up, sidecar(tmp_path, up, top) as (port, _, _):
        client = await RawH2(port).open()
        # The SETTINGS exchange done first: its ACK must not fall inside the header block.
        await client.until(lambda e: isinstance(e, RemoteSettingsChanged))
        client.flush()
        head = HeadersFrame(1)
        head.data = b"\x82"  # :method GET, and no END_HEADERS
        client.raw(head.serialize())
        for _ in range(3):  # 48,000 bytes > 4 x 8 KiB, far from 64 frames
            more = ContinuationFrame(1)
            more.data = b"\x00" * 16000
            client.raw(more.serialize())
        event = await client.until(terminated, timeout=5.0)  # not the head deadline (30 s)
        assert event is None or isinstance(event, ConnectionTerminated), event
        assert up.paths == []
        client.close()


@asynccontextmanager
async def distinct_fields() -> AsyncIterator[int]:
    """An app answering each request with a field no other answer has (1 KB)."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="ok", headers={"x-pad": os.urandom(500).hex()})

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


async def test_our_hpack_table_stays_small_whatever_the_client_advertises(tmp_path: Path) -> None:
    """A client advertising a 1 GiB SETTINGS_HEADER_TABLE_SIZE had every distinct answer field
    kept in the sidecar's HPACK encoder (memory and search time growing with the connection's
    life); the table our answers use is now at most 4,096 bytes."""
    async with (
        distinct_fields() as app_port,
        sidecar_on(tmp_path / "sidecar.yaml", app_port) as port,
    ):
        client = await RawH2(port).open({SettingCodes.HEADER_TABLE_SIZE: 2**30})
        client.conn.decoder.max_allowed_table_size = 2**30
        for i in range(40):
            client.request(1 + 2 * i, f"/x{i}")
            await client.until(ended(1 + 2 * i))
            assert status_of(client, 1 + 2 * i) == b"200"
        table = client.conn.decoder.header_table
        assert table.maxsize <= 4096 and table._current_size <= 4096, table.maxsize
        client.close()


@asynccontextmanager
async def sidecar_on(cfg: Path, app_port: int) -> AsyncIterator[int]:
    port, admin = free_port(), free_port()
    cfg.write_text(
        f"version: 1\nlisten: 127.0.0.1:{port}\nadmin: {{listen: 127.0.0.1:{admin}}}\n"
        f"routes:\n  - name: app\n    upstream: http://127.0.0.1:{app_port}\n"
    )
    proc = await launched(cfg, port, admin)
    try:
        yield port
    finally:
        proc.terminate()


async def test_a_path_in_absolute_form_is_malformed(tmp_path: Path) -> None:
    """``:path`` is origin-form in HTTP/2 (RFC 9113 section 8.3.1; ``*`` for OPTIONS only): an
    absolute-form one was sent upstream with its own authority as Host (``:authority`` said
    another); now it, and any path not starting with ``/``, is refused PROTOCOL_ERROR."""
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        client = await RawH2(port).open()
        for i, path in enumerate(["http://evil.test/m", "m", "*"]):
            client.request(1 + 2 * i, path)
            reset = await client.until(ended(1 + 2 * i))
            assert isinstance(reset, StreamReset), path
            assert reset.error_code == ErrorCodes.PROTOCOL_ERROR
        client.request(7, "/fine")
        await client.until(ended(7))
        assert status_of(client, 7) == b"200"
        assert up.paths == ["/fine"]
        assert up.headers[0]["Host"] == "example.test"
        client.close()
