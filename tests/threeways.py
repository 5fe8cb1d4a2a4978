"""One app, reached three ways: direct, through the real sidecar process with its shipped
defaults, and through nginx as a reverse proxy. A workload runs once per way against a fresh
app and gives a ``Tally``; the sidecar's must equal direct's (nginx's is shown beside them)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.difftools import make_tmp, start_nginx_proxy, stop
from tests.proc import SidecarProcess, free_port, start_process

WAYS = ("direct", "sidecar", "nginx")


@dataclass
class Tally:
    """What one run of a workload came to, one way."""

    outcome: dict[str, object]  # what the client saw; compared across ways
    answered: int  # requests (or client operations) that got the answer the app gives
    refused: int  # requests (or operations) that failed or were refused
    handled: dict[str, int] = field(default_factory=dict)  # handler runs the app counted
    seconds: float = 0.0

    @property
    def handler_runs(self) -> int:
        return sum(self.handled.values())


def nginx_available() -> bool:
    return shutil.which("nginx") is not None


async def shipped_defaults_sidecar(tmp_path: Path, upstream: str) -> tuple[SidecarProcess, int]:
    """The real process with nothing but its listeners, a DLQ path and one route: every policy
    key is the shipped default."""
    proc, port, _ = await start_process(
        tmp_path,
        f'dlq: {{path: "{tmp_path / "dlq.sqlite3"}"}}\n'
        f'routes:\n  - name: app\n    upstream: "{upstream}"\n',
    )
    return proc, port


@asynccontextmanager
async def front(way: str, app_port: int, tmp: Path) -> AsyncIterator[int]:
    """The port a client of ``app_port`` talks to, the given way; whatever was started for it
    is stopped (by PID) when the block is left."""
    if way == "direct":
        yield app_port
    elif way == "sidecar":
        where = tmp / "sidecar"
        where.mkdir(parents=True, exist_ok=True)
        proc, port = await shipped_defaults_sidecar(where, f"http://127.0.0.1:{app_port}")
        try:
            yield port
        finally:
            proc.terminate()
    elif way == "nginx":
        port = free_port()
        root = make_tmp()  # readable by nginx's workers (nobody, when the tests run as root)
        # No body limit: nginx in front of a git or S3 server is configured so (GitLab's
        # bundled nginx: client_max_body_size 0); its 1 MiB default would refuse the push.
        # Room for hundreds of long-polls (each holds a client and an upstream connection).
        try:
            ngx = start_nginx_proxy(port, app_port, app_port, root, max_body="0", connections=4096)
            try:
                yield port
            finally:
                stop(ngx)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        raise ValueError(f"unknown way {way!r}")
