"""What the CLI verbs print and exit with, against the real running process: a reader that
stops reading (``status | head -1``), ``-o json`` beside ``--json``, an empty DLQ, a replay the
upstream refused."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.conftest import reply, routes_yaml
from tests.proc import SidecarProcess, free_port, launched

PIPE_CLOSED = 141  # 128 + SIGPIPE: what the shell shows for git or cat stopped the same way


def run(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """The verb with its stdout a pipe whose reader is already gone: its first write fails
    (EPIPE), whatever it prints and however it buffers, so the case is deterministic."""
    read, write = os.pipe()
    os.close(read)
    try:
        return run(*args, stdout=write)
    finally:
        os.close(write)


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run, *args)


async def start(upstream_url: str, tmp_path: Path) -> tuple[SidecarProcess, Path, int, int]:
    port, admin = free_port(), free_port()
    text = routes_yaml(
        upstream_url,
        "    dlq: {enabled: true}",
        top_extra=f'dlq: {{path: "{tmp_path / "dlq.sqlite3"}"}}',
        admin=f'admin: {{listen: "127.0.0.1:{admin}"}}',
    ).replace('listen: "127.0.0.1:0"', f'listen: "127.0.0.1:{port}"', 1)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(text)
    return await launched(cfg, port, admin), cfg, port, admin


async def test_every_verb_that_prints_stops_quietly_when_its_reader_leaves(
    upstream_factory, tmp_path
):
    """Finding 13: ``status | head -1``, ``killswitch list | head`` and ``explain | head``
    printed a BrokenPipeError traceback and exited 1. A table over every verb that prints, in
    text and JSON: no traceback, nothing on stderr, exit 141."""
    up = await upstream_factory(reply(503))
    proc, cfg, port, _ = await start(up.url, tmp_path)
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.put(f"http://127.0.0.1:{port}/doc/1", data=b"v1") as r,
        ):
            rid = r.headers["x-retry-dlq-id"]
        c = ("--config", str(cfg))
        verbs: list[tuple[str, ...]] = [
            ("status", *c),
            ("status", "--json", *c),
            ("status", "-o", "json", *c),
            ("killswitch", "list", *c),
            ("killswitch", "list", "-o", "json", *c),
            ("dlq", "list", *c),
            ("dlq", "list", "--output", "json", *c),
            ("dlq", "list", "--route", "nope", *c),  # the empty list's line
            ("dlq", "show", rid, *c),
            ("dlq", "replay", "--dry-run", *c),
            ("idempotency", "show", "k-1", *c),  # an error: on stderr, stdout untouched
            ("healthcheck", *c),
            ("explain", str(cfg)),
            ("validate", str(cfg)),
            ("--version",),
            ("status", "--help"),
        ]
        results = await asyncio.gather(
            *(asyncio.to_thread(run_into_closed_pipe, *v) for v in verbs)
        )
    finally:
        assert proc.terminate() == 0
    for verb, res in zip(verbs, results, strict=True):
        if verb[0] == "idempotency":  # wrote nothing to stdout: its own error and status
            assert res.returncode == 1 and "Traceback" not in res.stderr, (verb, res.stderr)
            continue
        assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, (verb, res.stderr)
        assert res.stderr == "", (verb, res.stderr)
        # argparse's own --help and --version drop a failed write themselves and exit 0.
        want = 0 if verb[-1] in ("--help", "--version") else PIPE_CLOSED
        assert res.returncode == want, (verb, res.returncode)

    # And through a real shell pipeline, as typed.
    shell = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -m sidecar explain "{cfg}" | head -1'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shell.returncode == 0 and shell.stderr == "" and shell.stdout.strip(), shell


async def test_output_options_empty_list_and_a_refused_replay(upstream_factory, tmp_path):
    """Finding 13: an empty ``dlq list`` printed nothing; ``-o json`` was refused; ``dlq
    replay ID`` exited 0 when the upstream answered the replay with 503."""
    up = await upstream_factory(reply(503))
    proc, cfg, port, _ = await start(up.url, tmp_path)
    c = ("--config", str(cfg))
    try:
        empty = await cli("dlq", "list", *c)
        assert empty.returncode == 0 and empty.stdout == "no DLQ records\n", empty
        empty = await cli("dlq", "list", "--route", "main", "--status", "parked", *c)
        assert empty.stdout == "no DLQ records (route main, status parked)\n", empty
        for flag in (("--json",), ("-o", "json"), ("--output", "json"), ("--output=json",)):
            got = await cli("dlq", "list", *flag, *c)
            assert got.returncode == 0, (flag, got.stderr)
            assert json.loads(got.stdout) == {"records": [], "next": None}, flag
        for verb in (("status",), ("killswitch", "list")):
            as_json = await cli(*verb, "--json", *c)
            as_o = await cli(*verb, "-o", "json", *c)
            assert as_o.returncode == 0 and as_json.returncode == 0, as_o.stderr
            assert json.loads(as_o.stdout).keys() == json.loads(as_json.stdout).keys()
            text = await cli(*verb, "-o", "text", *c)
            assert text.returncode == 0 and not text.stdout.startswith("{"), text.stdout
        bad = await cli("status", "-o", "yaml", *c)
        assert bad.returncode == 2 and "invalid choice" in bad.stderr

        async with (
            aiohttp.ClientSession() as s,
            s.put(f"http://127.0.0.1:{port}/doc/1", data=b"v1") as r,
        ):
            rid = r.headers["x-retry-dlq-id"]
        refused = await cli("dlq", "replay", rid, *c)  # the upstream still answers 503
        assert refused.returncode == 1, refused
        assert json.loads(refused.stdout)["http_status"] == 503  # stdout stays the data
        assert refused.stderr == (
            f"error: replay of {rid} not delivered: the upstream answered 503 "
            "(fate exhausted); the record is pending\n"
        ), refused.stderr
        batch = await cli("dlq", "replay", *c)
        assert batch.returncode == 1 and f"replay of {rid} not delivered" in batch.stderr
        up.script = [reply(200)]
        done = await cli("dlq", "replay", rid, *c)
        assert done.returncode == 0 and done.stderr == "", done
        assert json.loads(done.stdout)["status"] == "delivered"
    finally:
        assert proc.terminate() == 0
