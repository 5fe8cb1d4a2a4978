"""The proxy listener over TLS (``server_tls``), against the real sidecar process (uvloop, as
shipped) with real clients: curl, requests, httpx, ``openssl s_client``, aiohttp's WebSocket
client, and raw ``ssl`` sockets. Certificates made per run (tests/tlscerts.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import httpx
import pytest
import requests
from aiohttp import web

from sidecar.proxy.certreload import (
    EXPIRED,
    INVALID,
    LOADED,
    MISMATCH,
    MISSING,
    Stamp,
    Step,
    step,
)
from sidecar.proxy.tlslisten import CERTIFICATE, GONE, HANDSHAKE, OK, handshake_result, xfcc
from tests.proc import SidecarProcess, free_port, launched
from tests.tlscerts import CertSet, Pair, make
from tests.wait import until

# A ClientHello cut short: the record header says 512 bytes, 2 come.
HALF_HELLO = b"\x16\x03\x01\x02\x00\x01\x00"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make(tmp_path_factory.mktemp("certs"))


@asynccontextmanager
async def echo_upstream() -> AsyncIterator[tuple[int, list[dict[str, str]]]]:
    """An app that records each request's headers and answers them as JSON; ``/slow`` waits
    0.8 s first; ``/ws`` is a WebSocket echo."""
    seen: list[dict[str, str]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        if request.path.endswith("/ws"):
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            async for msg in ws:
                await ws.send_str("echo:" + msg.data)
            return ws
        if request.path == "/slow":
            await asyncio.sleep(0.8)
        await request.read()
        return web.json_response(dict(request.headers))

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield int(runner.addresses[0][1]), seen
    finally:
        await runner.cleanup()


@asynccontextmanager
async def sidecar(
    tmp_path: Path, upstream: int, server_tls: str, top: str = "", forward: bool = True
) -> AsyncIterator[tuple[int, int, SidecarProcess]]:
    """The real process, its listener ``server_tls: {...}`` (empty: plaintext); two routes:
    ``/fwd`` forwards the client certificate, everything else does not."""
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    tls = f"server_tls: {{{server_tls}}}\n" if server_tls else ""
    cfg.write_text(
        f"version: 1\nlisten: 127.0.0.1:{port}\nadmin: {{listen: 127.0.0.1:{admin}}}\n{tls}{top}"
        f"routes:\n"
        f"  - name: fwd\n    upstream: http://127.0.0.1:{upstream}\n"
        f"    match: {{path_prefix: /fwd}}\n"
        + ("    forward_client_cert: true\n" if forward else "")
        + f"  - name: app\n    upstream: http://127.0.0.1:{upstream}\n"
    )
    proc = await launched(cfg, port, admin)
    try:
        yield port, admin, proc
    finally:
        proc.terminate()


def tls_keys(pair: Pair, ca: str | None = None, extra: str = "") -> str:
    out = f"cert_file: {pair.cert}, key_file: {pair.key}"
    if ca is not None:
        out += f", client_ca_file: {ca}"
    return out + (", " + extra if extra else "")


def metric(admin: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^retry_sidecar_{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def admin_json(admin: int, path: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}{path}", timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def open_fds(admin: int) -> int:
    return int(admin_json(admin, "/stats")["open_fds"])


async def settled_fds(admin: int) -> int:
    """The process's open files once start-up is over (a file opened at start for a moment
    would count otherwise)."""
    await asyncio.sleep(0.3)
    return min(open_fds(admin) for _ in range(3))


def client_context(certs: CertSet, pair: Pair | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=certs.ca)
    if pair is not None:
        ctx.load_cert_chain(pair.cert, pair.key)
    return ctx


def served_cert(port: int, certs: CertSet) -> str:
    """The SHA-256 of the certificate a new handshake gets now."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    with client_context(certs).wrap_socket(raw, server_hostname="localhost") as s:
        der = s.getpeercert(binary_form=True)
        assert der is not None
        return hashlib.sha256(der).hexdigest()


def leaf_sha256(pem_path: str) -> str:
    pem = Path(pem_path).read_text()
    first = pem[: pem.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")]
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(first)).hexdigest()


def subject(certs: CertSet) -> str:
    from cryptography import x509

    return x509.load_pem_x509_certificate(
        Path(certs.client.cert).read_bytes()
    ).subject.rfc4514_string()


def run(*cmd: str, data: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(cmd, input=data, capture_output=True, timeout=20, check=False)


# -- pure rules --------------------------------------------------------------------------------


def test_a_change_is_loaded_once_it_stood_still_for_one_poll_and_refused_once() -> None:
    a, b, c = Stamp(((1, 1, 1, 1),)), Stamp(((1, 2, 1, 1),)), Stamp(((1, 3, 1, 1),))
    assert step(a, None, a, a) is Step.SAME
    assert step(a, None, a, b) is Step.SETTLING  # just changed: one more look
    assert step(a, None, b, b) is Step.LOAD
    assert step(a, b, b, b) is Step.SAME  # refused already: not again every poll
    assert step(a, b, b, c) is Step.SETTLING  # changed again: looked at again
    assert step(b, None, a, b) is Step.SAME  # back to the pair in force


def test_handshake_results() -> None:
    assert handshake_result(None) == OK
    assert handshake_result(ssl.SSLCertVerificationError(1, "x")) == CERTIFICATE
    assert handshake_result(ssl.SSLEOFError(8, "eof")) == GONE
    assert handshake_result(ssl.SSLError(1, "PEER_DID_NOT_RETURN_A_CERTIFICATE")) == HANDSHAKE
    assert handshake_result(ConnectionResetError()) == GONE


def test_xfcc_is_envoys_hash_and_quoted_subject(certs: CertSet) -> None:
    from cryptography import x509

    leaf = x509.load_pem_x509_certificate(Path(certs.client.cert).read_bytes())
    der = ssl.PEM_cert_to_DER_cert(Path(certs.client.cert).read_text().split("\n\n")[0])
    value = xfcc(der).decode()
    assert value == (
        f'Hash={hashlib.sha256(der).hexdigest()};Subject="{leaf.subject.rfc4514_string()}"'
    )


def test_a_subject_with_line_breaks_and_controls_never_leaves_the_header(certs: CertSet) -> None:
    """A subject is the client's own text (an issuer that signs what tenants ask for): raw CR
    LF in it would end the XFCC field and start another field, or another request."""
    evil = certs.ca_obj.issue_cert(
        "client.example",
        organization_name='x\r\nContent-Length: 0\r\n\r\nGET /smuggled HTTP/1.1\r\nX-Pad: "\x01\u00e9',
    )
    der = ssl.PEM_cert_to_DER_cert(evil.cert_chain_pems[0].bytes().decode())
    value = xfcc(der)
    assert all(0x20 <= b < 0x7F for b in value), value
    assert b"\\x0d\\x0a" in value and b"\\x01" in value and b"\\xc3\\xa9" in value
    inner = value[value.index(b'Subject="') + 9 : -1]
    assert re.search(rb'(?<!\\)"', inner) is None  # every quote escaped: none ends it early


# -- clients -----------------------------------------------------------------------------------


async def test_curl_requests_and_httpx_over_tls_and_the_upstream_hears_https(
    tmp_path: Path, certs: CertSet
) -> None:
    async with (
        echo_upstream() as (up, seen),
        sidecar(tmp_path, up, tls_keys(certs.server)) as (port, admin, _),
    ):
        url = f"https://localhost:{port}/x"
        forged = 'Hash=00;Subject="CN=admin"'
        got = await asyncio.to_thread(
            run,
            "curl", "-sS", "--cacert", certs.ca, "-H", f"X-Forwarded-Client-Cert: {forged}",
            "-o", "/dev/null", "-w", "%{http_code} %{http_version} %{ssl_verify_result}", url,
        )  # fmt: skip
        assert got.stdout == b"200 2 0", got.stderr  # curl takes the h2 the listener offers
        r = await asyncio.to_thread(requests.get, url, verify=certs.ca, timeout=10)
        assert r.status_code == 200
        h = await asyncio.to_thread(httpx.get, url, verify=client_context(certs), timeout=10)
        assert h.status_code == 200
        assert [s.get("X-Forwarded-Proto") for s in seen] == ["https"] * 3
        assert all("X-Forwarded-Client-Cert" not in s for s in seen)  # the forged one dropped
        assert metric(admin, "tls_handshakes_total", side="listener", result="ok") == 3
        # A plaintext request to the TLS port: refused in the handshake, counted.
        plain = await asyncio.to_thread(
            run, "curl", "-sS", "-o", "/dev/null", f"http://127.0.0.1:{port}/x"
        )
        assert plain.returncode != 0
        await until(
            lambda: metric(admin, "tls_handshakes_total", side="listener", result=HANDSHAKE) == 1,
            "the plaintext request counted",
        )


async def test_a_plaintext_listener_sends_http_and_drops_a_clients_xfcc(tmp_path: Path) -> None:
    """No TLS listener: X-Forwarded-Proto stays http (as before); a client's
    X-Forwarded-Client-Cert never reaches the app (it passed before)."""
    async with (
        echo_upstream() as (up, seen),
        sidecar(tmp_path, up, "", forward=False) as (port, admin, _),
    ):
        for path in ("/x", "/fwd"):
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}{path}",
                headers={"X-Forwarded-Client-Cert": 'Hash=00;Subject="CN=admin"'},
            )
            await asyncio.to_thread(urllib.request.urlopen, req, timeout=10)
        assert [s.get("X-Forwarded-Proto") for s in seen] == ["http", "http"]
        assert all("X-Forwarded-Client-Cert" not in s for s in seen)
        assert metric(admin, "tls_handshakes_total", side="listener", result="ok") == 0


async def test_mutual_tls_refuses_no_certificate_and_another_cas_and_forwards_xfcc_when_asked(
    tmp_path: Path, certs: CertSet
) -> None:
    import trustme

    stranger = trustme.CA().issue_cert("client.example")
    other = tmp_path / "other-client.pem"
    other.write_bytes(b"".join(p.bytes() for p in stranger.cert_chain_pems))
    other_key = tmp_path / "other-client.key"
    other_key.write_bytes(stranger.private_key_pem.bytes())
    async with (
        echo_upstream() as (up, seen),
        sidecar(tmp_path, up, tls_keys(certs.server, certs.ca)) as (port, admin, _),
    ):
        base = ["curl", "-sS", "--cacert", certs.ca, "-o", "/dev/null", "-w", "%{http_code}"]
        none = await asyncio.to_thread(run, *base, f"https://localhost:{port}/x")
        assert none.returncode != 0 and none.stdout in (b"", b"000")
        wrong = await asyncio.to_thread(
            run, *base, "--cert", str(other), "--key", str(other_key), f"https://localhost:{port}/x"
        )
        assert wrong.returncode != 0
        cert = ["--cert", certs.client.cert, "--key", certs.client.key]
        for path in ("/x", "/fwd"):
            ok = await asyncio.to_thread(run, *base, *cert, f"https://localhost:{port}{path}")
            assert ok.stdout == b"200", ok.stderr
        assert len(seen) == 2
        assert "X-Forwarded-Client-Cert" not in seen[0]  # the route does not ask
        der_hash = leaf_sha256(certs.client.cert)
        assert seen[1]["X-Forwarded-Client-Cert"] == f'Hash={der_hash};Subject="{subject(certs)}"'
        assert "PRIVATE" not in json.dumps(seen)
        await until(
            lambda: (
                metric(admin, "tls_handshakes_total", side="listener", result=CERTIFICATE) == 1
                and metric(admin, "tls_handshakes_total", side="listener", result=HANDSHAKE) == 1
            ),
            "the stranger's certificate and the missing one counted",
        )
        assert metric(admin, "tls_handshakes_total", side="listener", result="ok") == 2


async def test_openssl_s_client_sees_tls13_alpn_and_a_resumed_session(
    tmp_path: Path, certs: CertSet
) -> None:
    async with (
        echo_upstream() as (up, _),
        sidecar(tmp_path, up, tls_keys(certs.server, extra='min_version: "1.3"')) as (
            port,
            _admin,
            _,
        ),
    ):
        sess = tmp_path / "sess.pem"
        req = b"GET /x HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        s_client = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-CAfile", certs.ca]
        first = await asyncio.to_thread(
            run, *s_client, "-alpn", "http/1.1", "-sess_out", str(sess), "-ign_eof", data=req
        )
        out = first.stdout.decode()
        assert "Protocol  : TLSv1.3" in out or "New, TLSv1.3" in out, out
        assert "ALPN protocol: http/1.1" in out
        assert "Verify return code: 0 (ok)" in out
        assert "HTTP/1.1 200" in out
        again = await asyncio.to_thread(run, *s_client, "-sess_in", str(sess), "-ign_eof", data=req)
        assert "Reused, TLSv1.3" in again.stdout.decode(), again.stdout.decode()
        old = await asyncio.to_thread(run, *s_client, "-tls1_2", data=b"")
        # min_version 1.3 refuses TLS 1.2 (uvloop closes without sending OpenSSL's alert)
        assert old.returncode != 0 and "HTTP/1.1" not in old.stdout.decode()


# -- the handshake deadline and sockets given back -----------------------------------------------


async def test_a_handshake_never_finished_is_closed_at_the_head_deadline_and_its_socket_freed(
    tmp_path: Path, certs: CertSet
) -> None:
    async with (
        echo_upstream() as (up, _),
        sidecar(tmp_path, up, tls_keys(certs.server), top="limits: {header_timeout: 1s}\n") as (
            port,
            admin,
            _,
        ),
    ):
        baseline = await settled_fds(admin)
        gone = metric(admin, "tls_handshakes_total", side="listener", result=GONE)  # the probe
        socks = []
        for i in range(20):
            s = socket.create_connection(("127.0.0.1", port))
            if i % 2:
                s.sendall(HALF_HELLO)  # a handshake begun, never finished
            socks.append(s)
        await until(lambda: open_fds(admin) >= baseline + 19, "the 20 connections accepted")
        started = time.monotonic()
        for s in socks:
            s.settimeout(5)
            assert await asyncio.to_thread(s.recv, 10) == b""  # closed by the sidecar
        took = time.monotonic() - started
        assert took < 30, took  # the head deadline, not uvloop's own 60 s
        await until(lambda: open_fds(admin) <= baseline, "every socket given back")
        assert metric(admin, "tls_handshakes_total", side="listener", result=GONE) == gone + 20
        for s in socks:
            s.close()


async def test_clients_gone_mid_handshake_give_back_their_sockets(
    tmp_path: Path, certs: CertSet
) -> None:
    async with (
        echo_upstream() as (up, _),
        sidecar(tmp_path, up, tls_keys(certs.server)) as (
            port,
            admin,
            _,
        ),
    ):
        baseline = await settled_fds(admin)
        gone = metric(admin, "tls_handshakes_total", side="listener", result=GONE)  # the probe
        for i in range(30):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(HALF_HELLO[: 1 + i % len(HALF_HELLO)])
            if i % 3 == 0:  # some reset rather than closed
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            s.close()
        await until(lambda: open_fds(admin) <= baseline, "every socket given back")
        await until(
            lambda: (
                metric(admin, "tls_handshakes_total", side="listener", result=GONE) == gone + 30
            ),
            "each counted connect-failure",
        )
        assert await asyncio.to_thread(served_cert, port, certs)  # still serving


async def test_sigterm_during_handshakes_exits_within_the_drain(
    tmp_path: Path, certs: CertSet
) -> None:
    async with (
        echo_upstream() as (up, _),
        sidecar(tmp_path, up, tls_keys(certs.server), top="drain_timeout: 2s\n") as (
            port,
            _admin,
            proc,
        ),
    ):
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        for s in socks:
            s.sendall(HALF_HELLO)
        await asyncio.sleep(0.2)
        assert proc.proc is not None
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.proc.wait, 15)
        assert rc == 0 and time.monotonic() - started < 4
        for s in socks:
            s.settimeout(5)
            assert s.recv(10) == b""
            s.close()


# -- request-side framing over TLS ----------------------------------------------------------------


async def test_requests_split_at_random_bytes_http10_and_close_over_tls(
    tmp_path: Path, certs: CertSet
) -> None:
    body = b"x" * 3000
    cases = [
        b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3000\r\n\r\n" + body,
        b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"bb8\r\n" + body + b"\r\n0\r\n\r\n",
        b"GET /x HTTP/1.0\r\n\r\n",
        b"POST /x HTTP/1.0\r\nContent-Length: 3000\r\n\r\n" + body,
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    ]
    rng = random.Random(31)

    def exchange(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with client_context(certs).wrap_socket(raw, server_hostname="localhost") as s:
                at = 0
                while at < len(data):
                    n = rng.randint(1, 700)
                    s.sendall(data[at : at + n])
                    at += n
                    time.sleep(0.001)
                if b"HTTP/1.1" in data[:20] and b"close" not in data:
                    s.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
                return got

    async with (
        echo_upstream() as (up, seen),
        sidecar(tmp_path, up, tls_keys(certs.server)) as (
            port,
            _admin,
            _,
        ),
    ):
        for data in cases:
            for _ in range(3):
                got = await asyncio.to_thread(exchange, data)
                assert got.startswith(b"HTTP/1.1 200") or got.startswith(b"HTTP/1.0 200"), got
                keep_alive = b"HTTP/1.1" in data[:20] and b"close" not in data
                assert got.count(b"HTTP/1.") == (2 if keep_alive else 1), got
        assert all(s.get("X-Forwarded-Proto") == "https" for s in seen)


async def test_wss_through_the_tls_listener_carries_the_forwarded_headers(
    tmp_path: Path, certs: CertSet
) -> None:
    async with (
        echo_upstream() as (up, seen),
        sidecar(tmp_path, up, tls_keys(certs.server, certs.ca)) as (port, _admin, _),
    ):
        ctx = client_context(certs, certs.client)
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(f"wss://localhost:{port}/fwd/ws", ssl=ctx) as ws,
        ):
            await ws.send_str("hi")
            assert (await ws.receive()).data == "echo:hi"
        assert seen[0]["X-Forwarded-Proto"] == "https"
        assert seen[0]["X-Forwarded-Client-Cert"].startswith(
            f"Hash={leaf_sha256(certs.client.cert)};"
        )


async def test_status_shows_the_listener_certificate_and_client_ca(
    tmp_path: Path, certs: CertSet
) -> None:
    async with (
        echo_upstream() as (up, _),
        sidecar(tmp_path, up, tls_keys(certs.server, certs.ca)) as (_port, admin, _),
    ):
        tls = admin_json(admin, "/status")["process"]["tls_listener"]
        assert tls["cert"]["sha256"] == leaf_sha256(certs.server.cert)
        assert tls["cert"]["subject"] and tls["cert"]["not_after"].endswith("Z")
        assert tls["cert"]["expires_in"] > 86400
        assert tls["client_ca"]["subject"] == tls["cert"]["issuer"]
        assert metric(admin, "tls_cert_expiry_seconds", use="listener") > 86400
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/?refresh=0", timeout=10) as r:
            page = r.read().decode()
        assert 'id="tls-cert"' in page and 'id="tls-client_ca"' in page


# -- rotation --------------------------------------------------------------------------------------


class SecretVolume:
    """A Kubernetes Secret volume as the kubelet writes it: ``..data`` -> a timestamped
    directory, ``tls.crt`` and ``tls.key`` links through ``..data``; an update writes a new
    directory and swaps ``..data`` with one rename."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.n = 0
        for name in ("tls.crt", "tls.key"):
            (root / name).symlink_to(f"..data/{name}")

    def put(self, cert: bytes | None, key: bytes | None) -> None:
        self.n += 1
        d = self.root / f"..2026_05_0{self.n}_12_00_00.{self.n}"
        d.mkdir()
        if cert is not None:
            (d / "tls.crt").write_bytes(cert)
        if key is not None:
            (d / "tls.key").write_bytes(key)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(d.name)
        tmp.rename(self.root / "..data")

    @property
    def pair(self) -> Pair:
        return Pair(str(self.root / "tls.crt"), str(self.root / "tls.key"))


def encrypted(certs: CertSet, name: str) -> bytes:
    """The key of ``name`` encrypted with a passphrase (``openssl pkey -aes256``)."""
    out = subprocess.run(
        ["openssl", "pkey", "-in", str(certs.dir / f"{name}.key"), "-aes256", "-passout", "pass:x"],
        capture_output=True,
        check=True,
    )
    return out.stdout


def pem(pair: Pair) -> tuple[bytes, bytes]:
    return Path(pair.cert).read_bytes(), Path(pair.key).read_bytes()


async def test_rotation_through_a_secret_volume_swap_keeps_open_connections(
    tmp_path: Path, certs: CertSet
) -> None:
    vol = SecretVolume(tmp_path / "secret")
    vol.put(*pem(certs.server))
    new = certs.issue("rotated", "localhost", "127.0.0.1")
    async with (
        echo_upstream() as (up, _),
        sidecar(tmp_path, up, tls_keys(vol.pair)) as (
            port,
            admin,
            _,
        ),
    ):
        assert await asyncio.to_thread(served_cert, port, certs) == leaf_sha256(certs.server.cert)
        # A keep-alive connection and a request in flight across the swap.
        import http.client

        kept = http.client.HTTPSConnection("localhost", port, context=client_context(certs))
        await asyncio.to_thread(kept.request, "GET", "/x")
        assert (await asyncio.to_thread(kept.getresponse)).read()
        sock = kept.sock
        slow = http.client.HTTPSConnection("localhost", port, context=client_context(certs))
        await asyncio.to_thread(slow.connect)
        in_flight = asyncio.create_task(asyncio.to_thread(_get, slow, "/slow"))
        await asyncio.sleep(0.1)

        vol.put(*pem(new))
        swapped = time.monotonic()
        want = leaf_sha256(new.cert)
        while await asyncio.to_thread(served_cert, port, certs) != want:
            assert time.monotonic() - swapped < 2.0, "the new pair not served within 2 s"
            await asyncio.sleep(0.05)
        took = time.monotonic() - swapped
        assert (await in_flight) == 200  # the request in flight across the swap finished
        await asyncio.to_thread(kept.request, "GET", "/x")  # the kept connection still works
        assert (await asyncio.to_thread(kept.getresponse)).status == 200
        assert kept.sock is sock
        assert metric(admin, "tls_reloads_total", result=LOADED) == 1
        status = admin_json(admin, "/status")["process"]["tls_listener"]
        assert status["cert"]["sha256"] == want
        print(f"rotation: new pair served {took:.2f} s after the swap")
        kept.close()
        slow.close()


def _get(conn: object, path: str) -> int:
    import http.client

    assert isinstance(conn, http.client.HTTPSConnection)
    conn.request("GET", path)
    resp = conn.getresponse()
    resp.read()
    return resp.status


async def test_a_broken_new_pair_is_refused_counted_and_the_old_one_keeps_serving(
    tmp_path: Path, certs: CertSet
) -> None:
    vol = SecretVolume(tmp_path / "secret")
    vol.put(*pem(certs.server))
    key = pem(certs.server)[1]
    other_cert, other_key = pem(certs.issue("other", "localhost", "127.0.0.1"))
    served = leaf_sha256(certs.server.cert)
    async with (
        echo_upstream() as (up, _),
        sidecar(tmp_path, up, tls_keys(vol.pair)) as (
            port,
            admin,
            proc,
        ),
    ):
        expected: dict[str, int] = {}
        for broken, result in (
            ((other_cert, key), MISMATCH),  # a key of another certificate
            ((other_cert[: len(other_cert) // 2], other_key), INVALID),  # half written
            ((other_cert, None), MISSING),  # the key missing
            ((other_cert, encrypted(certs, "other")), INVALID),  # a passphrase asked: never
            (pem(certs.expired), EXPIRED),  # every client would refuse it
        ):
            vol.put(*broken)
            expected[result] = expected.get(result, 0) + 1
            await until(
                lambda r=result: metric(admin, "tls_reloads_total", result=r) == expected[r],  # type: ignore[misc]
                f"the {result} pair refused",
            )
            assert await asyncio.to_thread(served_cert, port, certs) == served
        assert metric(admin, "tls_reloads_total", result=LOADED) == 0
        refused = [line for line in proc.stderr().splitlines() if "were refused" in line]
        assert len(refused) == 5, refused
        assert "the key is encrypted" in proc.stderr()
        status = admin_json(admin, "/status")["process"]["tls_listener"]
        assert status["cert"]["sha256"] == served and status["last_refused"].startswith("expired")
        vol.put(other_cert, other_key)  # a good pair again: in force
        await until(
            lambda: metric(admin, "tls_reloads_total", result=LOADED) == 1, "the good pair loaded"
        )
        assert await asyncio.to_thread(served_cert, port, certs) == leaf_sha256(
            str(certs.dir / "other.pem")
        )


async def test_the_tls_reload_task_is_named_listed_and_cancelled_on_stop(
    certs: CertSet,
) -> None:
    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text

    sc = Sidecar(
        parse_text(
            'version: 1\nlisten: "127.0.0.1:0"\nadmin: {listen: "127.0.0.1:0"}\n'
            f"server_tls: {{{tls_keys(certs.server)}}}\n"
            "routes:\n  - name: app\n    upstream: http://127.0.0.1:9\n"
        )
    )
    await sc.start()
    assert "tls-reload" in sc.task_names()
    task = next(t for t in asyncio.all_tasks() if t.get_name() == "tls-reload")
    await sc.stop()
    assert task.cancelled() and sc.task_names() == []


async def test_a_slow_head_over_tls_gives_its_socket_back_soon_after_its_408(
    tmp_path: Path, certs: CertSet
) -> None:
    """A TLS slowloris: handshakes done, heads never finished, the 408s never read. After the
    408 the sidecar sends its close_notify and waits briefly for the client's (uvloop waits
    30 s), so the sockets go back about when a plaintext listener's would."""
    async with (
        echo_upstream() as (up, _),
        sidecar(tmp_path, up, tls_keys(certs.server), top="limits: {header_timeout: 1s}\n") as (
            port,
            admin,
            _,
        ),
    ):
        baseline = await settled_fds(admin)
        ctx = client_context(certs)
        held = []
        for _ in range(20):
            raw = socket.create_connection(("127.0.0.1", port))
            tls = ctx.wrap_socket(raw, server_hostname="localhost")
            tls.sendall(b"GET /x HTTP/1.1\r\nHo")  # never finished, never read
            held.append(tls)
        await until(lambda: open_fds(admin) >= baseline + 20, "the 20 connections open")
        # the head deadline (1 s), then the shutdown wait: well under uvloop's 30 s
        await until(lambda: open_fds(admin) <= baseline, "every socket given back", timeout=15)
        for s in held:
            s.close()
