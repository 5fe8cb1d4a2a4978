"""Start the real ``retry-sidecar`` process for tests, and stop it by PID."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

# Ports free_port has handed out in this process. A port is only bound later, by whoever it
# is for, so the check that it is free says nothing about a port handed out a moment ago and
# not bound yet: ``port, admin = free_port(), free_port()`` could get the same port twice
# (1 in 12000 a pair; a suite has dozens of pairs), and the second listener fail to start.
_handed_out: set[int] = set()

ROOT = Path(__file__).resolve().parents[1]  # the checkout a child process imports sidecar from


def free_port() -> int:
    """A free port below the ephemeral range: polling connect() to an ephemeral-range port
    that nothing listens on yet can self-connect (source port == destination port) and then
    hold the very port the sidecar is about to bind. Never the same port twice in one run."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port found")


_logs = itertools.count(1)  # one log file per process started, even for one config


class SidecarProcess:
    """The real sidecar process. Its output goes to a file beside its config, never to a pipe
    nobody reads: a sidecar that logged more than a pipe holds (64 KiB) would block on it."""

    def __init__(self, config_path: Path, env: dict[str, str] | None = None) -> None:
        self.config_path = config_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = config_path.with_name(f"{config_path.name}.{next(_logs)}.log")

    def start(self) -> None:
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sidecar", "run", "--config", str(self.config_path)],
                env=self.env,
                stdout=log,
                stderr=log,
            )

    async def wait_port(self, *ports: int, timeout: float = 15.0) -> None:
        """Wait until every port given accepts a connection. The proxy listens before the
        admin API does, so a test that talks to both waits for both."""
        deadline = time.monotonic() + timeout
        for port in ports:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    err = self.stderr()
                    raise RuntimeError(f"sidecar exited with {self.proc.returncode}: {err}")
                try:
                    _, w = await asyncio.open_connection("127.0.0.1", port)
                    w.close()
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"sidecar did not listen on {port}") from None
                    await asyncio.sleep(0.05)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def stderr(self) -> str:
        """What the process wrote (its log lines go to stderr)."""
        return self.log_path.read_text(errors="replace")


async def start_process(tmp_path: Path, body: str) -> tuple[SidecarProcess, int, int]:
    """The real process, its proxy and admin API on free ports and ``body`` (the rest of the
    YAML) after them, once both listen: the process and the two ports. The caller stops it."""
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:{admin}"}}\n{body}'
    )
    return await launched(cfg, port, admin), port, admin


async def launched(cfg: Path, *ports: int, env: dict[str, str] | None = None) -> SidecarProcess:
    """The real process on ``cfg``, once every port given accepts; stopped by PID if it never
    does (a failed start leaves no process behind)."""
    proc = SidecarProcess(cfg, env)
    proc.start()
    try:
        await proc.wait_port(*ports)
    except BaseException:
        proc.terminate()
        raise
    return proc


@asynccontextmanager
async def proxying(
    tmp_path: Path, upstream: str, route: str = "", top: str = ""
) -> AsyncIterator[tuple[int, int, SidecarProcess]]:
    """The real process with one route, ``app``, to ``upstream`` (a URL): ``route`` adds keys
    to it (lines indented four spaces), ``top`` top-level keys; on free ports. Yields (listen
    port, admin port, process); stopped on every exit."""
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"version: 1\nlisten: 127.0.0.1:{port}\nadmin: {{listen: 127.0.0.1:{admin}}}\n{top}"
        f"routes:\n  - name: app\n    upstream: {upstream}\n{route}"
    )
    proc = await launched(cfg, port, admin)
    try:
        yield port, admin, proc
    finally:
        proc.terminate()


def run_until_line_then_kill(script: str, *args: str, line: bytes, timeout: float = 60.0) -> None:
    """Run ``python -c script *args`` on this checkout, read its output until ``line`` (a whole
    line, newline included) comes, then SIGKILL it by PID: no clean exit, no atexit, no close.
    Fails if it ends (or ``timeout`` s pass: it is killed then) without that line. The
    process is always killed and reaped, whatever happens while reading."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,  # held open: a script may block reading it until killed
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    # Killing it ends the read below (end of file), so a script that hangs silent fails.
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    seen: list[bytes] = []
    try:
        assert proc.stdout is not None
        for got in iter(proc.stdout.readline, b""):
            if got == line:
                return
            seen.append(got)
        raise AssertionError(f"the process ended without printing {line!r}; it printed {seen}")
    finally:
        watchdog.cancel()
        proc.kill()  # SIGKILL, by its PID, unless it is already reaped
        proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
