"""Start a real ``redis-server`` for tests, and stop it by PID.

Each server has its own directory and a free loopback port, appends every write to its AOF
and fsyncs it before answering (``appendonly yes``, ``appendfsync always``, no RDB snapshots:
``save ""``), as docs/fleet.md asks of a Redis that fleet mode relies on. A test can kill it
(SIGKILL) and start it again on the same directory and port, or pause it (SIGSTOP) and let it
go on (SIGCONT). ``stop`` always ends it: a paused server is resumed before SIGTERM, and one
that does not exit in time gets SIGKILL. No fake Redis, ever: without the binary the tests
that need it skip and say so (``.ci/run`` installs Debian's ``redis-server``).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.proc import free_port

BINARY = "redis-server"
START_BOUND = 15.0  # seconds for PING to answer after a start (a loaded CI machine)


def available() -> bool:
    return shutil.which(BINARY) is not None


def ping(port: int, timeout: float = 1.0) -> bool:
    """True when a Redis on ``port`` answers PING with PONG now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def server_pid(port: int, timeout: float = 1.0) -> int | None:
    """The process id of the Redis answering on ``port`` (``INFO server``), None if none does."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"INFO server\r\n")
            data = b""
            while b"process_id:" not in data or not data.endswith(b"\r\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    for line in data.decode(errors="replace").splitlines():
        if line.startswith("process_id:"):
            return int(line.split(":", 1)[1])
    return None


class RedisServer:
    """One ``redis-server`` process on ``port`` with its files in ``directory``."""

    def __init__(self, directory: Path, port: int | None = None, extra: Sequence[str] = ()) -> None:
        self.directory = directory
        self.extra = list(extra)  # more command-line settings, e.g. --maxmemory 10mb
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.log_path = directory / "redis.log"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        return [
            BINARY,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            "--protected-mode", "yes",
            *self.extra,
        ]  # fmt: skip

    def start(self) -> None:
        """Start it (again, on the same directory and port) and wait until PING answers."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.paused = False
        self.starts += 1
        deadline = time.monotonic() + START_BOUND
        # Ours answering, not another server that holds the port; and done loading its AOF
        # (while loading, INFO answers but every command gets -LOADING, PING included).
        while server_pid(self.port) != self.proc.pid or not ping(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() >= deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer PING on {self.port}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: what a crash does; only what its AOF holds survives."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.paused = False

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the socket stays open and accepts, but nothing is answered."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self, timeout: float = 10.0) -> None:
        """End it on every path: resumed if paused, SIGTERM, SIGKILL past ``timeout``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        if self.paused:
            self.resume()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


@contextlib.contextmanager
def running(directory: Path, *extra: str) -> Iterator[RedisServer]:
    """A started server, stopped however the block is left; skips when redis-server is not
    installed."""
    if not available():
        pytest.skip("redis-server is not installed (.ci/run installs Debian's redis-server)")
    server = RedisServer(directory, extra=extra)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server in ``tmp_path/redis`` for one test."""
    with running(tmp_path / "redis") as server:
        yield server
