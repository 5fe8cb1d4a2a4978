"""HTTP/2 on the proxy listener, against the real sidecar process (uvloop, as shipped) with real
peers: curl ``--http2-prior-knowledge``, httpx ``http2=True`` (h2c and h2 over the TLS
listener), ``nghttp`` and ``h2load``, and a raw client on the ``h2`` package for what no polite
client does (resets, floods, bombs, a window kept shut). The upstream is a real aiohttp app on
loopback that records what it was asked and which requests were cut."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import ssl
import subprocess
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
)
from h2.settings import SettingCodes
from hyperframe.frame import ContinuationFrame, HeadersFrame

from tests.proc import SidecarProcess, proxying
from tests.tlscerts import CertSet, make
from tests.wait import until


class Upstream:
    """What the app was asked: paths in order, the headers of each, requests cut short."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.cut: list[str] = []
        self.flaky: set[str] = set()
        self.port = 0


@asynccontextmanager
async def upstream() -> AsyncIterator[Upstream]:
    seen = Upstream()

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.paths.append(request.path_qs)
        seen.headers.append(dict(request.headers))
        try:
            if request.path == "/flaky":
                key = request.query.get("k", "")
                if key not in seen.flaky:
                    seen.flaky.add(key)
                    return web.Response(status=503, text="once")
            if request.path == "/slow":
                await asyncio.sleep(float(request.query.get("s", "5")))
            if request.path == "/big":
                return web.Response(body=b"b" * int(request.query.get("n", "300000")))
            body = await request.read()
            return web.Response(text=f"ok {len(body)}")
        except asyncio.CancelledError:
            seen.cut.append(request.path_qs)
            raise

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        seen.port = int(runner.addresses[0][1])
        yield seen
    finally:
        await runner.cleanup()


def sidecar(
    tmp_path: Path, up: Upstream, top: str = "", route: str = ""
) -> AbstractAsyncContextManager[tuple[int, int, SidecarProcess]]:
    """The real sidecar with one route to ``up``."""
    return proxying(tmp_path, f"http://127.0.0.1:{up.port}", route, top)


def rss_kib(proc: SidecarProcess) -> int:
    assert proc.proc is not None
    for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class RawH2:
    """A client on the ``h2`` state machine over a plain socket."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self.events: list[Event] = []
        self.closed = False
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self, settings: dict[int, int] | None = None) -> RawH2:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.conn.initiate_connection()
        if settings:
            self.conn.update_settings(settings)
        self.flush()
        return self

    def flush(self) -> None:
        assert self._writer is not None
        if not self._writer.is_closing():
            self._writer.write(self.conn.data_to_send())

    def raw(self, data: bytes) -> None:
        assert self._writer is not None
        self._writer.write(data)

    def request(self, sid: int, path: str, *, end: bool = True, extra: Any = ()) -> None:
        head = [(b":method", b"GET" if end else b"POST"), (b":scheme", b"http")]
        head += [(b":path", path.encode()), (b":authority", b"example.test"), *extra]
        self.conn.send_headers(sid, head, end_stream=end)
        self.flush()

    async def until(self, done: Callable[[Event], bool], timeout: float = 10.0) -> Event | None:
        """Read events until one satisfies ``done`` (returned), or the connection closes."""
        assert self._reader is not None
        async with asyncio.timeout(timeout):
            while True:
                for event in self.events:
                    if done(event):
                        return event
                if self.closed:
                    return None
                try:
                    data = await self._reader.read(65536)
                except ConnectionError:
                    data = b""
                if not data:
                    self.closed = True
                    continue
                self.events.extend(self.conn.receive_data(data))
                if self._writer is not None and not self._writer.is_closing():
                    self._writer.write(self.conn.data_to_send())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def ended(sid: int) -> Callable[[Event], bool]:
    return lambda e: isinstance(e, (StreamEnded, StreamReset)) and e.stream_id == sid


def status_of(client: RawH2, sid: int) -> bytes | None:
    for e in client.events:
        if isinstance(e, ResponseReceived) and e.stream_id == sid:
            return dict(e.headers or []).get(b":status")
    return None


def terminated(e: Event) -> bool:
    return isinstance(e, ConnectionTerminated)


# -- real peers -------------------------------------------------------------------------------


async def test_curl_h2c_prior_knowledge_and_http11_share_the_listen_port(tmp_path: Path) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        for args, version in ((["--http2-prior-knowledge"], "2"), ([], "1.1")):
            out = await asyncio.to_thread(
                subprocess.run,
                [
                    "curl",
                    "-sS",
                    *args,
                    "-w",
                    "\\n%{http_version} %{http_code}",
                    f"http://127.0.0.1:{port}/hello",
                ],
                capture_output=True,
                timeout=20,
            )
            assert out.stdout.decode().splitlines()[-1] == f"{version} 200", out
        assert up.headers[0]["Host"] == f"127.0.0.1:{port}"  # its :authority


async def test_httpx_h2c_and_h2_over_the_tls_listener_by_alpn(tmp_path: Path) -> None:
    certs: CertSet = make(tmp_path / "certs")
    tls = f"server_tls: {{cert_file: {certs.server.cert}, key_file: {certs.server.key}}}\n"
    async with upstream() as up:
        async with sidecar(tmp_path, up) as (port, _, _):
            async with httpx.AsyncClient(http1=False, http2=True) as client:
                r = await client.get(f"http://127.0.0.1:{port}/plain")
            assert (r.http_version, r.status_code, r.text) == ("HTTP/2", 200, "ok 0")
        (tmp_path / "tls").mkdir()
        async with sidecar(tmp_path / "tls", up, top=tls) as (port, _, _):
            ctx = ssl.create_default_context(cafile=certs.ca)
            async with httpx.AsyncClient(http2=True, verify=ctx) as client:
                r = await client.post(f"https://localhost:{port}/tls", content=b"x" * 100_000)
            assert (r.http_version, r.status_code, r.text) == ("HTTP/2", 200, "ok 100000")
            async with httpx.AsyncClient(http2=False, verify=ctx) as client:
                r = await client.get(f"https://localhost:{port}/h1")
            assert (r.http_version, r.status_code) == ("HTTP/1.1", 200)
        assert up.headers[-2]["X-Forwarded-Proto"] == "https"


async def test_a_retry_happens_under_an_h2_client(tmp_path: Path) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        async with httpx.AsyncClient(http1=False, http2=True) as client:
            r = await client.get(f"http://127.0.0.1:{port}/flaky?k=1")
        assert (r.status_code, r.headers["x-retry-attempts"], r.text) == (200, "2", "ok 0")
        assert up.paths == ["/flaky?k=1", "/flaky?k=1"]


async def test_100_concurrent_streams_on_one_connection(tmp_path: Path) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(http1=False, http2=True, limits=limits) as client:
            rs = await asyncio.gather(
                *(client.get(f"http://127.0.0.1:{port}/slow?s=0.3&i={i}") for i in range(100))
            )
        assert [r.status_code for r in rs] == [200] * 100
        assert len(up.paths) == 100


# nghttp and h2load come with Debian's nghttp2-client (.ci/run installs it): skipped without.
NGHTTP2 = pytest.mark.skipif(
    shutil.which("nghttp") is None or shutil.which("h2load") is None,
    reason="nghttp2-client (nghttp, h2load) is not installed",
)


@NGHTTP2
async def test_nghttp_and_h2load(tmp_path: Path) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        out = await asyncio.to_thread(
            subprocess.run,
            ["nghttp", "-v", f"http://127.0.0.1:{port}/n"],
            capture_output=True,
            timeout=20,
        )
        text = out.stdout.decode()
        assert "SETTINGS_MAX_CONCURRENT_STREAMS(0x03):100" in text
        assert "SETTINGS_MAX_HEADER_LIST_SIZE(0x06):32768" in text
        assert ":status: 200" in text
        load = await asyncio.to_thread(
            subprocess.run,
            ["h2load", "-n", "400", "-c", "2", "-m", "50", f"http://127.0.0.1:{port}/l"],
            capture_output=True,
            timeout=60,
        )
        assert "400 succeeded, 0 failed, 0 errored" in load.stdout.decode(), load.stdout


# -- what a client's reset gives back ---------------------------------------------------------

BULKHEAD_ONE = "    bulkhead: {max_concurrent: 1, queue_timeout: 0s}\n"


async def test_a_stream_reset_half_way_cuts_its_upstream_request_and_gives_back_its_slot(
    tmp_path: Path,
) -> None:
    async with upstream() as up, sidecar(tmp_path, up, route=BULKHEAD_ONE) as (port, _, _):
        client = await RawH2(port).open()
        client.request(1, "/slow?s=30")
        await until(lambda: up.paths == ["/slow?s=30"], "the upstream has the request")
        client.conn.reset_stream(1, ErrorCodes.CANCEL)
        client.flush()
        await until(lambda: up.cut == ["/slow?s=30"], "the upstream request cut", timeout=3)
        # The bulkhead's one slot is back: the next request on the same connection is served.
        client.request(3, "/after")
        await client.until(ended(3))
        assert status_of(client, 3) == b"200"
        client.close()


async def test_an_upload_reset_half_way_gives_back_the_connection_window(tmp_path: Path) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        client = await RawH2(port).open()
        client.request(1, "/up", end=False, extra=[(b"content-length", b"1000000")])
        for _ in range(4):
            client.conn.send_data(1, b"u" * 15_000)
        client.flush()
        await asyncio.sleep(0.3)
        client.conn.reset_stream(1, ErrorCodes.CANCEL)
        client.flush()
        # 65,535 bytes is the connection's whole window: a second upload of 200,000 bytes
        # goes through only if the first one's unread bytes were given back.
        client.request(3, "/up2", end=False, extra=[(b"content-length", b"200000")])
        sent = 0
        while sent < 200_000:
            room = min(client.conn.local_flow_control_window(3), 200_000 - sent, 16384)
            if room > 0:
                client.conn.send_data(3, b"v" * room, end_stream=sent + room == 200_000)
                sent += room
                client.flush()
            else:
                assert not client.closed, "the connection closed during the upload"
                await _pump(client)
        await client.until(ended(3))
        assert status_of(client, 3) == b"200"
        assert "/up2" in up.paths
        client.close()


async def _pump(client: RawH2) -> None:
    """Read what has come (window updates) without waiting for anything in particular."""
    with suppress(TimeoutError):
        await client.until(lambda e: False, timeout=0.1)


# -- limits advertised and enforced ----------------------------------------------------------


async def test_max_concurrent_streams_advertised_and_one_more_refused(tmp_path: Path) -> None:
    top = "http2: {max_concurrent_streams: 2}\n"
    async with upstream() as up, sidecar(tmp_path, up, top=top) as (port, _, _):
        client = await RawH2(port).open()
        await client.until(lambda e: isinstance(e, RemoteSettingsChanged))
        assert client.conn.remote_settings.max_concurrent_streams == 2
        # disobey: the client's own h2 would not open a third
        client.conn.remote_settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS] = deque([10])
        for sid in (1, 3, 5):
            client.request(sid, f"/slow?s=1&i={sid}")
        refused = await client.until(ended(5))
        assert isinstance(refused, StreamReset)
        assert refused.error_code == ErrorCodes.REFUSED_STREAM
        await client.until(ended(3))
        assert status_of(client, 1) == status_of(client, 3) == b"200"
        assert sorted(up.paths) == ["/slow?s=1&i=1", "/slow?s=1&i=3"]
        client.close()


async def test_malformed_requests_are_stream_errors(tmp_path: Path) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        client = await RawH2(port).open()
        cases = [
            [(b"connection", b"keep-alive")],
            [(b"transfer-encoding", b"chunked")],
            [(b"upgrade", b"h2c")],
            [(b"te", b"gzip")],
            [(b"x-a", b"1\r\nx-b: 2")],
        ]
        client.conn.config.validate_outbound_headers = False
        client.conn.config.normalize_outbound_headers = False
        for i, extra in enumerate(cases):
            sid = 1 + 2 * i
            client.request(sid, f"/m{i}", extra=extra)
            reset = await client.until(ended(sid))
            assert isinstance(reset, StreamReset), extra
            assert reset.error_code == ErrorCodes.PROTOCOL_ERROR
        cookies = [(b"cookie", b"a=1"), (b"te", b"trailers"), (b"cookie", b"b=2")]
        client.request(99, "/fine", extra=cookies)
        await client.until(ended(99))
        assert status_of(client, 99) == b"200"
        assert up.paths == ["/fine"]
        # :authority became Host; the cookie fields one, joined with "; " (RFC 9113 8.2.3)
        assert (up.headers[0]["Host"], up.headers[0]["Cookie"]) == ("example.test", "a=1; b=2")
        client.close()


# -- the named attacks: memory and upstream requests stay bounded ---------------------------


async def test_rapid_reset_ends_the_connection_with_enhance_your_calm(tmp_path: Path) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, proc):
        before = rss_kib(proc)
        client = await RawH2(port).open()
        sid = 1
        for _ in range(50):
            for _ in range(100):
                client.request(sid, "/slow?s=30")
                client.conn.reset_stream(sid, ErrorCodes.CANCEL)
                sid += 2
            client.flush()
            await asyncio.sleep(0)
        goaway = await client.until(terminated)
        assert isinstance(goaway, ConnectionTerminated)
        assert goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
        await asyncio.sleep(0.5)
        assert len(up.paths) <= 200, len(up.paths)  # at most the reset burst reached it
        assert rss_kib(proc) - before < 40_000
        client.close()


async def test_continuation_flood_closes_the_connection(tmp_path: Path) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, proc):
        before = rss_kib(proc)
        client = await RawH2(port).open()
        head = HeadersFrame(1)
        head.data = b"\x82"  # :method GET, and never END_HEADERS
        client.raw(head.serialize())
        for _ in range(2000):
            more = ContinuationFrame(1)
            more.data = b"\x40\x01a\x01b" * 2000
            client.raw(more.serialize())
        await client.until(terminated)
        assert client.closed or any(terminated(e) for e in client.events)
        assert up.paths == []
        assert rss_kib(proc) - before < 40_000
        client.close()


async def test_a_header_block_never_finished_is_closed_at_the_head_deadline(
    tmp_path: Path,
) -> None:
    """A first request's headers, begun and never ended (no END_HEADERS, no CONTINUATION),
    are due within limits.header_timeout as an HTTP/1.1 head is: the connection is closed
    then, not at the keep-alive timeout (75 s), and nothing reaches the upstream."""
    top = "limits: {header_timeout: 1s}\n"
    async with upstream() as up, sidecar(tmp_path, up, top) as (port, _, _proc):
        client = await RawH2(port).open()
        head = HeadersFrame(1)
        head.data = b"\x82"  # :method GET, and never END_HEADERS
        client.raw(head.serialize())
        await client.until(terminated, timeout=30.0)  # the head deadline, not keep-alive's 75 s
        assert client.closed or any(terminated(e) for e in client.events)
        assert up.paths == []
        client.close()


async def test_hpack_bomb_over_the_header_list_size_closes_the_connection(tmp_path: Path) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, proc):
        before = rss_kib(proc)
        client = await RawH2(port).open()
        await client.until(lambda e: isinstance(e, RemoteSettingsChanged))
        assert client.conn.remote_settings.max_header_list_size == 32 * 1024
        # One 4 KiB field indexed once, then referenced 2,000 times: ~4 KiB on the wire that
        # decodes to 8 MB.
        bomb = [(b"x-bomb", b"a" * 4000)] * 2000
        client.request(1, "/bomb", extra=bomb)
        await client.until(terminated)
        assert up.paths == []
        assert rss_kib(proc) - before < 40_000
        client.close()


@pytest.mark.parametrize("flood", ["ping", "settings", "priority"])
async def test_control_frame_floods_end_the_connection(tmp_path: Path, flood: str) -> None:
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, proc):
        before = rss_kib(proc)
        client = await RawH2(port).open()
        for i in range(5000):
            if flood == "ping":
                client.conn.ping(b"%08d" % i)
            elif flood == "priority":
                client.conn.prioritize(2 * i + 1)
            else:
                client.conn.update_settings({SettingCodes.ENABLE_PUSH: 0})
        client.flush()
        goaway = await client.until(terminated)
        assert isinstance(goaway, ConnectionTerminated)
        assert goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
        assert up.paths == []
        assert rss_kib(proc) - before < 40_000
        client.close()


async def test_zero_window_stall_resets_the_stream_after_the_send_timeout(tmp_path: Path) -> None:
    top = "limits: {send_timeout: 1s}\n"
    async with (
        upstream() as up,
        sidecar(tmp_path, up, top=top, route=BULKHEAD_ONE) as (
            port,
            _,
            _,
        ),
    ):
        client = await RawH2(port).open({SettingCodes.INITIAL_WINDOW_SIZE: 0})
        client.request(1, "/big?n=2000000")
        reset = await client.until(ended(1), timeout=15)
        assert isinstance(reset, StreamReset)
        assert reset.error_code == ErrorCodes.CANCEL
        got = sum(len(e.data or b"") for e in client.events if isinstance(e, DataReceived))
        assert got == 0
        # Its bulkhead slot and upstream connection are back: the next stream is served.
        client.conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 65535})
        client.request(3, "/after")
        await client.until(ended(3))
        assert status_of(client, 3) == b"200"
        client.close()


# -- the drain --------------------------------------------------------------------------------


@NGHTTP2
async def test_sigterm_sends_goaway_and_lets_the_stream_in_flight_finish(tmp_path: Path) -> None:
    # nghttp: h2's own client takes a GOAWAY as the end of every stream.
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, proc):
        client = await asyncio.create_subprocess_exec(
            "nghttp",
            "-v",
            f"http://127.0.0.1:{port}/slow?s=1.5",
            stdout=asyncio.subprocess.PIPE,
        )
        await until(lambda: up.paths == ["/slow?s=1.5"], "the upstream has the request")
        assert proc.proc is not None
        os.kill(proc.proc.pid, signal.SIGTERM)
        out, _ = await asyncio.wait_for(client.communicate(), 20)
        text = out.decode()
        assert "recv GOAWAY frame" in text, text
        assert "last_stream_id=13, error_code=NO_ERROR" in text, text  # nghttp opens 13
        assert text.index("recv GOAWAY") < text.index(":status: 200"), text
        assert await asyncio.to_thread(proc.proc.wait, 10) == 0


# -- the sniffer: requests split at random byte boundaries ------------------------------------


async def _send_split(writer: asyncio.StreamWriter, data: bytes, rng: random.Random) -> None:
    i = 0
    while i < len(data):
        n = rng.randint(1, 7) if i < 30 else rng.randint(1, 200)
        writer.write(data[i : i + n])
        await writer.drain()
        await asyncio.sleep(0.002)
        i += n


async def test_h2c_and_http1_split_at_random_byte_boundaries(tmp_path: Path) -> None:
    rng = random.Random(32)
    async with upstream() as up, sidecar(tmp_path, up) as (port, _, _):
        for seed in range(5):
            conn = H2Connection(H2Configuration(client_side=True, header_encoding=None))
            conn.initiate_connection()
            conn.send_headers(
                1,
                [
                    (b":method", b"GET"),
                    (b":scheme", b"http"),
                    (b":path", f"/h2/{seed}".encode()),
                    (b":authority", b"s.test"),
                ],
                end_stream=True,
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await _send_split(writer, conn.data_to_send(), rng)
            status = None
            async with asyncio.timeout(10):
                while status is None:
                    for e in conn.receive_data(await reader.read(65536)):
                        if isinstance(e, ResponseReceived):
                            status = dict(e.headers or [])[b":status"]
            assert status == b"200"
            writer.close()
        # HTTP/1.1 and 1.0 starting with "P" (as the preface does), keep-alive or close.
        for version, close in (("1.1", False), ("1.1", True), ("1.0", False)):
            head = f"PUT /h1/{version}/{close} HTTP/{version}\r\nHost: s.test\r\n"
            head += "Connection: close\r\n" if close else ""
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await _send_split(writer, (head + "Content-Length: 2\r\n\r\nhi").encode(), rng)
            line = await asyncio.wait_for(reader.readline(), 10)
            assert line.startswith(f"HTTP/{version} 200".encode()), line
            writer.close()
        assert sorted(up.paths)[:3] == ["/h1/1.0/False", "/h1/1.1/False", "/h1/1.1/True"]
        assert len(up.paths) == 8
