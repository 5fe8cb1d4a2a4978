"""A real gRPC server (grpcio's, threaded) on loopback for the gRPC tests: four methods on raw
bytes (generic handlers, identity serializers, no generated code), each call answered by the
next step of a per-test plan and recorded as it arrived.

Methods (``test.Echo``):

- ``/test.Echo/Unary`` (unary-unary): answers the request.
- ``/test.Echo/ServerStream`` (unary-stream): answers ``request + b"#" + i`` for i in 0..n-1
  (n: the step's ``messages``, 3 when not given).
- ``/test.Echo/ClientStream`` (stream-unary): reads the whole request stream, answers the
  messages joined.
- ``/test.Echo/Bidi`` (stream-stream): echoes each message as it comes (a ping-pong client
  works), ends when the client half-closes.

A plan (``Peer.plan``) is a queue of ``Step``: each call takes the next step queued for its
method (else the next queued for any method; else ``Step()``, a plain answer). A step can fail
with a status after K response messages, wait before answering, send trailing metadata
(``grpc-retry-pushback-ms``...), or send its headers early. A failure before any message is
aborted, so grpcio answers Trailers-Only (one HEADERS frame with END_STREAM and grpc-status);
grpcio holds the response headers back until the first message, so a call that fails later has
headers, DATA and trailers.

What grpcio shows a server: every request header but the reserved ones -- it keeps
``grpc-previous-rpc-attempts`` (sent by a proxy or a raw client; grpcio's own client sends one
given as metadata only with its retries off, as tests/grpcclient.py's channels have them) but
not ``grpc-timeout``, which becomes the call's deadline: ``Call.time_remaining`` (read on
arrival) is how a test sees it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tests.difftools import run_nginx, stop, wait_port
from tests.proc import free_port

SERVICE = "test.Echo"
UNARY = f"/{SERVICE}/Unary"
SERVER_STREAM = f"/{SERVICE}/ServerStream"
CLIENT_STREAM = f"/{SERVICE}/ClientStream"
BIDI = f"/{SERVICE}/Bidi"
METHODS = (UNARY, SERVER_STREAM, CLIENT_STREAM, BIDI)
STREAM_COUNT = 3  # ServerStream's messages when the step does not say
NO_DEADLINE = 1e9  # seconds: grpcio's time_remaining for a call without a deadline is ~9.2e18


@dataclass(frozen=True)
class Step:
    """How the server answers one call.

    ``code``: the final status (OK: a normal answer). ``messages``: response messages sent
    before the status, for ServerStream and Bidi (Unary and ClientStream: an OK step sends its
    one message, a failing one none); None: the normal count (3 for ServerStream, every echo
    for Bidi) for an OK step, 0 for a failing one (aborted before any message: Trailers-Only). ``delay``: seconds
    before the first message or the status; ``gap``: seconds between streamed messages (both
    cut short when the call ends: a cancelled call's handler returns at once). ``trailers``:
    trailing metadata, e.g. ``(("grpc-retry-pushback-ms", "100"),)`` (in the Trailers-Only
    HEADERS when nothing else was sent). ``headers_first``: send the response headers before
    the delay, so even a failure before any message is not Trailers-Only."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    messages: int | None = None
    delay: float = 0.0
    gap: float = 0.0
    trailers: tuple[tuple[str, str], ...] = ()
    headers_first: bool = False


def fail(code: grpc.StatusCode, times: int = 1, **kw: Any) -> list[Step]:
    """``times`` steps failing with ``code`` (then the plan runs out: plain answers)."""
    return [Step(code=code, details=f"scripted {code.name.lower()}", **kw)] * times


@dataclass
class Call:
    """One call as the server received it. ``requests`` grows as request messages arrive;
    ``cancelled``: the call ended (the client's cancel or RST_STREAM, a deadline, a connection
    gone) before its handler finished; ``ended`` is set once the call is over, either way."""

    method: str
    metadata: tuple[tuple[str, str | bytes], ...]
    time_remaining: float | None  # seconds left on arrival (grpc-timeout); None: no deadline
    peer: str  # the client's address ("ipv4:127.0.0.1:PORT"): one per upstream connection
    step: Step
    requests: list[bytes] = field(default_factory=list)
    cancelled: bool = False
    ended: threading.Event = field(default_factory=threading.Event)
    handler_done: bool = False

    def header(self, name: str) -> str | bytes | None:
        """The last value of request metadata ``name`` (lower case), or None."""
        found = None
        for k, v in self.metadata:
            if k == name:
                found = v
        return found


class Peer:
    """The server's state: the plan and the calls received. ``port``/``target`` once started."""

    def __init__(self) -> None:
        self.port = 0
        self.calls: list[Call] = []
        self._plans: dict[str | None, deque[Step]] = {}
        self._lock = threading.Lock()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def plan(self, *steps: Step | Iterable[Step], method: str | None = None) -> None:
        """Queue ``steps`` (steps or lists of steps, as ``fail`` returns) for ``method``'s
        calls, or for any method's when None. Calls arriving after the queue is empty get a
        plain answer."""
        flat: list[Step] = []
        for s in steps:
            flat.extend([s] if isinstance(s, Step) else s)
        with self._lock:
            self._plans.setdefault(method, deque()).extend(flat)

    def reset(self) -> None:
        """Forget the plan and the calls (a module-scoped peer between tests)."""
        with self._lock:
            self._plans.clear()
            self.calls = []

    def calls_to(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    # -- the handlers ------------------------------------------------------------------------

    def _begin(self, method: str, ctx: grpc.ServicerContext) -> Call:
        with self._lock:
            queue = self._plans.get(method) or self._plans.get(None)
            step = queue.popleft() if queue else Step()
            call = Call(
                method,
                tuple((m.key, m.value) for m in ctx.invocation_metadata()),
                _deadline(ctx.time_remaining()),
                ctx.peer(),
                step,
            )
            self.calls.append(call)

        def over() -> None:
            call.cancelled = not call.handler_done
            call.ended.set()

        if not ctx.add_callback(over):  # already over before it began
            over()
        if step.headers_first:
            ctx.send_initial_metadata(())
        return call

    @staticmethod
    def _wait(call: Call, seconds: float) -> bool:
        """Wait ``seconds`` (cut short if the call ends); whether the call is still on."""
        if seconds > 0:
            call.ended.wait(seconds)
        return not call.ended.is_set()

    @staticmethod
    def _finish(call: Call, ctx: grpc.ServicerContext) -> None:
        """The step's status and trailers (abort raises: grpcio sends them)."""
        call.handler_done = True
        step = call.step
        if step.trailers:
            ctx.set_trailing_metadata(step.trailers)
        if step.code != grpc.StatusCode.OK:
            ctx.abort(step.code, step.details)

    def unary(self, request: bytes, ctx: grpc.ServicerContext) -> bytes:
        call = self._begin(UNARY, ctx)
        call.requests.append(request)
        self._wait(call, call.step.delay)
        self._finish(call, ctx)
        return request

    def server_stream(self, request: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
        call = self._begin(SERVER_STREAM, ctx)
        call.requests.append(request)
        n = _count(call.step, STREAM_COUNT) or 0
        if not self._wait(call, call.step.delay):
            return
        for i in range(n):
            if i and not self._wait(call, call.step.gap):
                return
            yield request + b"#" + str(i).encode()
        self._finish(call, ctx)

    def client_stream(self, requests: Iterator[bytes], ctx: grpc.ServicerContext) -> bytes:
        call = self._begin(CLIENT_STREAM, ctx)
        for r in requests:
            call.requests.append(r)
        self._wait(call, call.step.delay)
        self._finish(call, ctx)
        return b"".join(call.requests)

    def bidi(self, requests: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
        call = self._begin(BIDI, ctx)
        limit = _count(call.step, None)
        if not self._wait(call, call.step.delay):
            return
        if limit != 0:
            for r in requests:
                call.requests.append(r)
                if len(call.requests) > 1 and not self._wait(call, call.step.gap):
                    return
                yield r
                if limit is not None and len(call.requests) >= limit:
                    break
        self._finish(call, ctx)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream),
                "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream),
                "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi),
            },
        )


def _deadline(remaining: float | None) -> float | None:
    """grpcio's time_remaining, None for a call without a deadline (grpcio: about 2**63 ns)."""
    return None if remaining is None or remaining > NO_DEADLINE else remaining


def _count(step: Step, normal: int | None) -> int | None:
    """How many response messages ``step`` sends before its status."""
    if step.messages is not None:
        return step.messages
    return normal if step.code == grpc.StatusCode.OK else 0


@contextmanager
def serving(workers: int = 128, port: int = 0) -> Iterator[Peer]:
    """The server on loopback (``port``, or one the kernel picks: bound before it is yielded,
    so no other listener can take it); yields the ``Peer``. ``workers``: calls handled at once
    (a call waiting in a step's delay holds one). Stopped on every exit, within 2 s: calls still
    running are cancelled."""
    peer = Peer()
    pool = futures.ThreadPoolExecutor(workers, thread_name_prefix="grpcpeer")
    server = grpc.server(pool, options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((peer.handler(),))
    try:
        peer.port = server.add_insecure_port(f"127.0.0.1:{port}")
        if not peer.port:
            raise OSError(f"grpc server could not bind 127.0.0.1:{port}")
        server.start()
        yield peer
    finally:
        server.stop(grace=0.5).wait(2)
        pool.shutdown(wait=False, cancel_futures=True)


# -- nginx as the gRPC reference: grpc_pass in front of a peer -----------------------------------

NGINX_GRPC = """\
  upstream grpc_up {{ server 127.0.0.1:{upstream}; keepalive 32; }}
  server {{
    listen 127.0.0.1:{port} http2;
    error_log {root}/grpc-error.log info;
    grpc_read_timeout 60s;
    grpc_send_timeout 60s;
    location / {{ grpc_pass grpc://grpc_up; }}
  }}
"""


@contextmanager
def nginx_grpc(root: Path, upstream: int) -> Iterator[int]:
    """nginx with ``listen PORT http2`` (h2c with prior knowledge) and ``grpc_pass`` to
    ``127.0.0.1:upstream`` (keep-alive upstream connections), its files under ``root``;
    yields its port once it listens. Stopped by PID on every exit (SIGTERM, SIGKILL after
    10 s)."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # its workers may run as nobody
    port = free_port()
    proc = run_nginx(root, NGINX_GRPC.format(port=port, upstream=upstream, root=root))
    try:
        wait_port(port, proc, "nginx grpc_pass")
        yield port
    finally:
        stop(proc)
        if proc.stderr is not None:
            proc.stderr.close()
