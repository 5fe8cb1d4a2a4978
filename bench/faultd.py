"""The fault-injecting upstream and the relay app of the storm benchmark (bench/storm.py).

    python3 -m bench.faultd upstream --port P --fault 503:0.6 [--seed S] [--outage A:B]
    python3 -m bench.faultd upstream --port P --capacity 5:50ms        # overload model
    python3 -m bench.faultd relay --port P --next http://127.0.0.1:Q

Every request names its id in the path (``/r/<id>``). The upstream counts the arrivals of each
id: the first is attempt 1, the next attempt 2, whoever sent it. Whether an attempt fails is a
deterministic function of (seed, id, attempt) -- so nginx, HAProxy and retry-sidecar, each
retrying in its own way, all meet exactly the same pattern. Faults:

    503:P        503 with probability P per attempt
    503ra:P      503 with ``Retry-After: 1`` with probability P
    reset:P      the connection is closed without an answer (an empty response)
    slow:P:D     the answer (200) comes after D (e.g. 3s)
    ok           no fault

``--outage A:B`` makes every attempt of ids A..B-1 fail with 503 (a full outage of the
requests sent during that time). ``--capacity W:S`` is an upstream that can work on W requests
at once, S each, queueing the rest first in, first out; it finishes a request its client has
left (as most application servers do), which is why an overload turns into timeouts.

``GET /__stats`` answers ``{"calls": N}`` (arrivals of ``/r/`` paths), ``POST /__reset``
forgets the counts (between products). The relay forwards ``/r/`` requests to ``--next`` with
the retry headers an instrumented app propagates and answers with the status and body it got
(not the headers: an app does not pass its dependency's headers on).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import socket
import struct
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

PROPAGATED = (
    "x-retry-edge",
    "x-request-timeout-ms",
    "tracestate",
    "idempotency-key",
    "content-type",
)


def unit(seed: int, rid: int, attempt: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, id, attempt)."""
    h = hashlib.blake2b(f"{seed}:{rid}:{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


@dataclass
class Fault:
    kind: str = "ok"
    p: float = 0.0
    delay: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.split(":")
        if parts[0] == "ok":
            return cls()
        if parts[0] == "slow":
            return cls("slow", float(parts[1]), parse_seconds(parts[2]))
        return cls(parts[0], float(parts[1]))


def parse_seconds(text: str) -> float:
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    return float(text.rstrip("s"))


@dataclass
class Upstream:
    fault: Fault
    seed: int
    outage: tuple[int, int] | None
    capacity: asyncio.Semaphore | None
    service: float
    calls: int = 0
    outage_calls: int = 0
    seen: dict[int, int] = field(default_factory=dict)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path == "/__stats":
            return web.json_response({"calls": self.calls, "outage_calls": self.outage_calls})
        if path == "/__reset":
            self.calls = 0
            self.outage_calls = 0
            self.seen.clear()
            return web.json_response({"ok": True})
        await request.read()
        self.calls += 1
        try:
            rid = int(path.rsplit("/", 1)[1])
        except (ValueError, IndexError):
            rid = -1
        attempt = self.seen.get(rid, 0) + 1
        self.seen[rid] = attempt
        if self.capacity is not None:
            async with self.capacity:  # FIFO: asyncio.Semaphore wakes waiters in order
                await asyncio.sleep(self.service)
            return web.Response(text="ok")
        if self.outage is not None and self.outage[0] <= rid < self.outage[1]:
            self.outage_calls += 1
            return web.Response(status=503, text="outage")
        f = self.fault
        hit = f.kind != "ok" and unit(self.seed, rid, attempt) < f.p
        if not hit:
            return web.Response(text="ok")
        if f.kind == "503":
            return web.Response(status=503, text="fault")
        if f.kind == "503ra":
            return web.Response(status=503, text="fault", headers={"Retry-After": "1"})
        if f.kind == "slow":
            await asyncio.sleep(f.delay)
            return web.Response(text="ok")
        if f.kind == "reset":
            transport = request.transport
            if transport is not None:
                sock = transport.get_extra_info("socket")
                if sock is not None:  # RST, not FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort()
            return web.Response(status=500)
        raise ValueError(f"unknown fault {f.kind}")


class Relay:
    def __init__(self, next_url: str) -> None:
        self.next_url = next_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=120),
                auto_decompress=False,
            )
            self.session._retry_connection = False  # one attempt: the tiers own retries
        body = await request.read()
        headers = {h: request.headers[h] for h in PROPAGATED if h in request.headers}
        try:
            async with self.session.request(
                request.method, self.next_url + request.path, data=body or None, headers=headers
            ) as resp:
                data = await resp.read()
                return web.Response(status=resp.status, body=data)
        except (aiohttp.ClientError, TimeoutError):
            return web.Response(status=502, text="relay: next tier failed")


async def serve(handler: web.Server, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(handler, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    import uvloop

    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("upstream", "relay"))
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--fault", default="ok")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--outage", default=None, help="A:B, ids failing every attempt")
    ap.add_argument("--capacity", default=None, help="W:S, e.g. 5:50ms")
    ap.add_argument("--next", default=None)
    args = ap.parse_args()
    if args.role == "upstream":
        outage = None
        if args.outage:
            a, b = args.outage.split(":")
            outage = (int(a), int(b))
        cap, service = None, 0.0
        if args.capacity:
            w, s = args.capacity.split(":")
            cap, service = int(w), parse_seconds(s)

        async def run_upstream() -> None:
            up = Upstream(
                Fault.parse(args.fault),
                args.seed,
                outage,
                asyncio.Semaphore(cap) if cap else None,
                service,
            )
            await serve(web.Server(up.handle, access_log=None), args.port)

        uvloop.run(run_upstream())
    else:
        relay = Relay(args.next)

        async def run_relay() -> None:
            await serve(web.Server(relay.handle, access_log=None), args.port)

        uvloop.run(run_relay())


if __name__ == "__main__":
    main()
