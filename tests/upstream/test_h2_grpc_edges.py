"""What a fresh attack on the HTTP/2 upstream and gRPC found, each against the real sidecar and
a real h2 server (tests/h2peer.py): a graceful GOAWAY lets the calls it covers finish (never
sent again), a stream reset after the upstream had the request is CANCELLED or INTERNAL as gRPC
reads it (retried only when listed), an upstream that allows no stream is not stormed with
connections, a deadline already passed sends nothing, an HTTP 503 is UNAVAILABLE, and the
sidecar's own gRPC answer is framed for an HTTP/1.1 client."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp

from tests.grpcclient import raw_call
from tests.h2peer import serving
from tests.upstream.test_h2_upstream import through


def grpc(port: int, path: str, *headers: tuple[str, str]) -> tuple[str | None, dict[str, str]]:
    answer = raw_call(port, path, (b"x",), headers)
    return answer.status, dict(answer.headers + answer.trailers)


async def test_a_graceful_goaway_lets_the_call_it_covers_finish_once(tmp_path: Path) -> None:
    """GOAWAY NO_ERROR whose last id is the call's own stream, then its answer: relayed, and
    the call is not sent again (the h2 state machine closes at a GOAWAY; before, the answer
    broke the connection and the call went out a second time)."""
    async with serving() as (up, seen), through(tmp_path, up) as (port, _, _):
        status, fields = await asyncio.to_thread(grpc, port, "/goaway-then-answer")
    assert status == "0" and fields["x-retry-attempts"] == "1"
    assert seen.paths() == ["/goaway-then-answer"]


async def test_a_stream_reset_after_the_request_is_cancelled_and_not_sent_again(
    tmp_path: Path,
) -> None:
    """The upstream had the whole request and reset the stream CANCEL: gRPC reads that as
    CANCELLED, which the default retry_on does not list (before: retried as a ``reset``, the
    call run twice)."""
    async with serving() as (up, seen), through(tmp_path, up) as (port, _, _):
        status, fields = await asyncio.to_thread(grpc, port, "/rst-cancel")
        assert seen.paths() == ["/rst-cancel"]
        assert status == "1" and fields["x-retry-fate"] == "not-retryable"
        # a route that lists cancelled retries it
    async with (
        serving() as (up, seen),
        through(tmp_path, up, "    retry: {retry_on: [cancelled], backoff: {base: 1ms}}\n") as (
            port,
            _,
            _,
        ),
    ):
        status, _ = await asyncio.to_thread(grpc, port, "/rst-cancel")
    assert status == "1" and seen.paths() == ["/rst-cancel"] * 3


async def test_an_upstream_that_allows_no_stream_gets_one_connection(tmp_path: Path) -> None:
    async with serving(max_streams=0) as (up, seen), through(tmp_path, up) as (port, _, _):
        for _ in range(3):
            status, fields = await asyncio.to_thread(grpc, port, "/echo")
            assert status == "14" and fields["x-retry-proxy-error"] == "connect-failure"
    assert seen.connections == 1 and seen.streams == []


async def test_a_deadline_already_passed_sends_nothing(tmp_path: Path) -> None:
    async with serving() as (up, seen), through(tmp_path, up) as (port, _, _):
        for value in ("0m", "0S", "1n", "999u"):
            status, fields = await asyncio.to_thread(grpc, port, "/echo", ("grpc-timeout", value))
            assert status == "4" and fields["x-retry-proxy-error"] == "deadline", value
    assert seen.streams == []


async def test_an_http_503_to_a_grpc_call_is_unavailable(tmp_path: Path) -> None:
    """gRPC reads an HTTP 503 as UNAVAILABLE: a route that lists only gRPC's word retries it."""
    route = "    retry: {retry_on: [unavailable], backoff: {base: 1ms}}\n"
    async with serving() as (up, seen), through(tmp_path, up, route) as (port, _, _):
        answer = await asyncio.to_thread(raw_call, port, "/status?code=503", (b"x",))
    assert dict(answer.headers)[":status"] == "503"
    assert len(seen.streams) == 3


async def test_the_sidecars_grpc_answer_to_an_http1_client_is_framed(tmp_path: Path) -> None:
    """No END_STREAM in HTTP/1.1: the Trailers-Only answer carries Content-Length: 0, and the
    connection serves the next request (before: no framing, the client waited for the close)."""
    async with serving() as (up, _), through(tmp_path, up) as (port, _, proc):
        proc.terminate()  # nothing listens upstream any more: the sidecar answers itself
    dead = tmp_path / "dead"
    dead.mkdir()
    async with through(dead, up) as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = (
            b"POST /svc/M HTTP/1.1\r\nHost: x\r\ncontent-type: application/grpc\r\n"
            b"Content-Length: 6\r\n\r\n\x00\x00\x00\x00\x01x"
        )
        for _ in range(2):
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert b"grpc-status: 14" in head and b"content-length: 0" in head.lower()
        writer.close()


async def test_a_request_cancelled_while_its_connection_opens_leaves_nothing(
    tmp_path: Path,
) -> None:
    """An upstream that takes the TCP connection and never sends its SETTINGS: a client that
    leaves while its request waits for that connection is cancelled alone; the shared connect
    ends at the connect timeout and closes its socket; the next request gets a connect failure
    (UNAVAILABLE), not a hang."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent.setblocking(False)
    up = silent.getsockname()[1]
    loop = asyncio.get_running_loop()
    try:
        async with through(tmp_path, up, "    retry: {attempts: 1}\n") as (port, _, _):
            task = asyncio.ensure_future(asyncio.to_thread(grpc, port, "/echo"))
            conn, _ = await asyncio.wait_for(loop.sock_accept(silent), 10)
            task.cancel()  # the thread's call runs on; its socket is closed below
            # the shared connect gives up at upstream_pool.connect_timeout (1 s) and closes
            conn.setblocking(False)
            got = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(conn, 65536), 10):
                got += chunk  # its preface and SETTINGS, then the close (b"")
            assert got.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            status, fields = await asyncio.to_thread(grpc, port, "/echo")
            assert status == "14" and fields["x-retry-proxy-error"] == "connect-failure"
            conn.close()
    finally:
        silent.close()


async def test_an_early_answer_frees_its_stream_on_the_connection(tmp_path: Path) -> None:
    """The upstream answers before the request body is all sent: the stream is reset on our
    side too, so it does not hold one of the connection's streams for good (an upstream that
    allows two streams serves request after request on one connection)."""
    async with (
        serving(max_streams=2) as (up, seen),
        through(tmp_path, up) as (port, _, _),
        aiohttp.ClientSession() as s,
    ):
        for _ in range(5):
            async with s.post(f"http://127.0.0.1:{port}/early", data=b"u" * 3_000_000) as r:
                assert r.status == 200 and await r.read() == b"early"
    assert seen.connections == 1
