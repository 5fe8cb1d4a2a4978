"""A proxied request leaves nothing for the cyclic garbage collector.

Everything a request allocates should be freed by reference counting when the request ends.
An object caught in a reference cycle lives on until a collection finds it: memory held for
nothing, more collections, and more objects for each one to walk. The compiled build made one
such cycle per request (mypyc keeps nested functions in an environment object that also holds
the functions; see sidecar/engine/sender.py), which only a test like this one can see: both
builds run it (CI's second pass runs the suite against the compiled build).
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import CodeType, CoroutineType, FrameType, FunctionType
from typing import Any

import aiohttp

from tests.conftest import Running, Upstream, reply, routes_yaml


def _from_sidecar(obj: Any) -> str | None:
    """What names ``obj`` as made by the sidecar's code, if anything does."""
    module = getattr(type(obj), "__module__", "") or ""
    if module.startswith("sidecar."):
        return f"{module}.{type(obj).__qualname__}"
    code: CodeType | None = None
    if isinstance(obj, FunctionType):
        code = obj.__code__
    elif isinstance(obj, FrameType):
        code = obj.f_code
    elif isinstance(obj, CoroutineType):
        code = obj.cr_code
    if code is not None and "/sidecar/" in code.co_filename:
        return f"{type(obj).__name__} {code.co_name} ({code.co_filename})"
    return None


@contextmanager
def garbage_kept() -> Iterator[list[Any]]:
    """Cyclic garbage made inside the block, kept for inspection instead of freed."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found: list[Any] = []
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def _requests(
    client: aiohttp.ClientSession, url: str, n: int, method: str = "GET", body: bytes = b""
) -> list[int]:
    statuses = []
    for _ in range(n):
        async with client.request(method, url, data=body or None) as r:
            await r.read()
            statuses.append(r.status)
    return statuses


async def test_requests_that_succeed_retry_or_fail_leave_no_cyclic_garbage(
    upstream_factory: Callable[..., Awaitable[Upstream]],
    sidecar_factory: Callable[..., Awaitable[Running]],
    client: aiohttp.ClientSession,
) -> None:
    ok = await upstream_factory(reply(200, b"x" * 100))
    # Every third request is answered 503 once, then 200: a retried sequence.
    flaky = await upstream_factory(reply(503), reply(200), reply(200))
    down = await upstream_factory(reply(502))
    # The catch-all route comes first in routes_yaml, so it matches only /a here.
    sc = await sidecar_factory(
        routes_yaml(
            ok.url,
            route_extra=f"""    match: {{path_prefix: /a}}
  - name: flaky
    match: {{path_prefix: /flaky}}
    upstream: "{flaky.url}"
  - name: down
    match: {{path_prefix: /down}}
    upstream: "{down.url}"
    retry: {{attempts: 2}}
""",
        )
    )
    # Warm up: first requests fill caches (label tuples, pooled connections).
    await _requests(client, sc.url + "/a", 3)
    await _requests(client, sc.url + "/down", 1)

    with garbage_kept() as garbage:
        assert await _requests(client, sc.url + "/a", 20) == [200] * 20
        assert await _requests(client, sc.url + "/a", 5, "POST", b"y" * 1000) == [200] * 5
        assert (await _requests(client, sc.url + "/flaky", 3))[0] == 200
        assert await _requests(client, sc.url + "/down", 3) == [502] * 3

    made_here = sorted({name for obj in garbage if (name := _from_sidecar(obj))})
    assert made_here == [], f"{len(garbage)} objects in cycles, the sidecar's: {made_here}"
    # The test sees what it looks for: a cycle made by sidecar code is reported.
    assert len(flaky.seen) >= 2 and len(down.seen) >= 6
