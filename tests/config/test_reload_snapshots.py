"""Reloads at random moments of live retried sequences: each sequence keeps, for all its
attempts, the config snapshot it started with, and no request or attempt is lost."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from aiohttp import web

from tests.conftest import Seen

SEQUENCES = 40
RELOADS = 12


def version(up_url: str, k: int, attempts: int) -> str:
    """Config ``v<k>``: its name (sent upstream as x-retry-edge on every attempt) says which
    snapshot an attempt belongs to; its ``attempts`` how many the sequence must make."""
    return f"""version: 1
name: v{k}
listen: "127.0.0.1:0"
admin: {{listen: "127.0.0.1:0"}}
defaults:
  retry: {{attempts: {attempts}, backoff: {{strategy: constant, base: 1ms, max: 1ms}}}}
  breaker: {{enabled: false}}
  throttle: {{enabled: false}}
  hedge: {{enabled: false}}
  budget: {{ratio: 100, min_per_second: 100000}}
routes:
  - name: main
    upstream: "{up_url}"
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_reloads_at_random_moments_keep_each_sequence_on_its_snapshot(
    upstream_factory, sidecar_factory, client, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    pauses = random.Random(seed + 1000)  # the upstream's, drawn in arrival order

    async def slow_503(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(pauses.uniform(0, 0.01))
        return web.Response(status=503)

    up = await upstream_factory(slow_503)
    attempts = {f"v{k}": rng.randint(2, 5) for k in range(RELOADS + 1)}
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(version(up.url, 0, attempts["v0"]))
    sc = await sidecar_factory(cfg.read_text(), config_path=str(cfg))

    async def one(i: int) -> tuple[int, str, str]:
        await asyncio.sleep(rng.uniform(0, 0.25))
        async with client.get(f"{sc.url}/s/{i}", headers={"x-seq": str(i)}) as resp:
            await resp.read()
            return resp.status, resp.headers["x-retry-attempts"], resp.headers["x-retry-fate"]

    async def reloads() -> None:
        for k in range(1, RELOADS + 1):
            await asyncio.sleep(rng.uniform(0, 0.025))
            cfg.write_text(version(up.url, k, attempts[f"v{k}"]))
            result = await sc.sidecar.reload("test")
            assert result is not None and result.ok and result.changed

    answers, _ = await asyncio.gather(
        asyncio.gather(*(one(i) for i in range(SEQUENCES))), reloads()
    )

    by_seq: dict[str, list[Seen]] = {}
    for seen in up.seen:
        by_seq.setdefault(seen.header("x-seq") or "?", []).append(seen)
    assert sorted(by_seq) == sorted(str(i) for i in range(SEQUENCES))  # none lost, none extra
    names_used = set()
    for i, (status, n, fate) in enumerate(answers):
        tries = by_seq[str(i)]
        [name] = {t.header("x-retry-edge") for t in tries}  # one snapshot for all attempts
        assert name is not None
        names_used.add(name)
        assert [t.header("x-retry-attempt") for t in tries] == [
            str(a) for a in range(1, attempts[name] + 1)
        ]
        assert (status, n, fate) == (503, str(attempts[name]), "exhausted")
    assert sum(len(t) for t in by_seq.values()) == len(up.seen)
    assert len(names_used) > 1  # the reloads did land among the sequences
