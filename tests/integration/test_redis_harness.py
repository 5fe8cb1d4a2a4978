"""The real redis-server the fleet tests run (tests/redisserver.py): its own directory and
port, every acknowledged write on disk before the answer (AOF, fsync always), killed and
started again on the same files, paused and resumed, and always stopped by PID."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.redisserver import RedisServer, ping, running


def command(port: int, *words: str, timeout: float = 5.0) -> bytes:
    """One RESP command over a fresh connection; the raw reply."""
    parts = [f"*{len(words)}\r\n".encode()]
    for w in words:
        b = w.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"".join(parts))
        return s.recv(4096)


def test_a_write_acknowledged_before_sigkill_is_there_after_the_restart(tmp_path: Path) -> None:
    with running(tmp_path / "r") as server:
        assert command(server.port, "CONFIG", "GET", "appendfsync").endswith(b"always\r\n")
        assert command(server.port, "SET", "k", "v") == b"+OK\r\n"
        pid = server.proc.pid if server.proc else 0
        server.restart()  # SIGKILL, then the same directory and port
        assert server.proc is not None and server.proc.pid != pid
        assert command(server.port, "GET", "k") == b"$1\r\nv\r\n"
        assert server.starts == 2


def test_a_paused_server_answers_nothing_until_resumed_and_stop_ends_it_paused(
    tmp_path: Path,
) -> None:
    with running(tmp_path / "r") as server:
        server.pause()
        assert not ping(server.port, timeout=0.3)
        server.resume()
        assert ping(server.port)
        server.pause()
        proc = server.proc
    # left paused: the context stopped it anyway
    assert proc is not None and proc.poll() is not None
    assert not ping(server.port, timeout=0.3)


def test_a_server_that_cannot_start_is_reported_and_left_stopped(tmp_path: Path) -> None:
    with running(tmp_path / "a") as first:
        second = RedisServer(tmp_path / "b", port=first.port)  # the port is taken
        with pytest.raises(RuntimeError, match="exited"):
            second.start()
        assert second.proc is not None and second.proc.poll() is not None
