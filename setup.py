"""Build: pure Python by default for editable installs, the hot path compiled with mypyc for
wheels and the image.

RETRY_SIDECAR_BUILD selects the build:
  (unset)   wheels and `pip install .`: compiled when mypyc can type-check the code (mypy and the
            runtime dependencies importable: `pip install --no-build-isolation`), else pure with a
            warning; a failing C compiler also falls back to pure. Editable installs stay pure so
            that edits take effect.
  compiled  compiled or fail (the image, CI's compiled run).
  pure      never compiled (the opt-out).
`retry-sidecar --version` says which build runs.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

# The modules every request runs through: the pure retry rules, the engine, the upstream client,
# proxy handler, header rules and telemetry events/metrics. The rest (CLI, admin, config parsing,
# DLQ, the aiohttp server and response subclasses, the request-body reader) stays interpreted: it
# is not on the per-request path, or it subclasses aiohttp's classes, which mypyc cannot compile,
# or it awaits inside a ``finally`` block, whose exception unwinding mypyc gets wrong
# (upstream/upload.py).
COMPILED = [
    "sidecar/core.py",
    "sidecar/outcomes.py",
    "sidecar/retry/backoff.py",
    "sidecar/retry/breaker.py",
    "sidecar/retry/budget.py",
    "sidecar/retry/classify.py",
    "sidecar/retry/deadline.py",
    "sidecar/retry/decide.py",
    "sidecar/retry/retry_after.py",
    "sidecar/retry/window.py",
    "sidecar/retry/throttle.py",
    "sidecar/retry/concurrency.py",
    "sidecar/retry/latency.py",
    "sidecar/retry/endpoints.py",
    "sidecar/engine/answered.py",
    "sidecar/engine/attempted.py",
    "sidecar/engine/attempter.py",
    "sidecar/engine/bulkhead.py",
    "sidecar/engine/gate.py",
    "sidecar/engine/head.py",
    "sidecar/engine/loop.py",
    "sidecar/engine/routestate.py",
    "sidecar/engine/sender.py",
    "sidecar/engine/sequence.py",
    "sidecar/proxy/forward.py",
    "sidecar/proxy/admission.py",
    "sidecar/proxy/context.py",
    "sidecar/proxy/frontend.py",
    "sidecar/proxy/h1.py",
    "sidecar/proxy/handler.py",
    "sidecar/proxy/handoff.py",
    "sidecar/proxy/held.py",
    "sidecar/proxy/intake.py",
    "sidecar/proxy/relay.py",
    "sidecar/proxy/run.py",
    "sidecar/upstream/client.py",
    "sidecar/upstream/connection.py",
    "sidecar/upstream/pool.py",
    "sidecar/upstream/responsehead.py",
    "sidecar/upstream/states.py",
    "sidecar/proxy/routing.py",
    "sidecar/telemetry/events.py",
    "sidecar/telemetry/metrics.py",
    "sidecar/telemetry/requestlog.py",
]


def ext_modules() -> list[object]:
    mode = os.environ.get("RETRY_SIDECAR_BUILD", "").strip().lower()
    if mode not in ("", "compiled", "pure"):
        raise SystemExit(f"RETRY_SIDECAR_BUILD={mode!r}: use compiled, pure, or leave it unset")
    if mode == "pure" or (mode == "" and "editable_wheel" in sys.argv):
        return []
    try:
        from mypyc.build import mypycify

        exts = mypycify(COMPILED, opt_level="3", debug_level="0")
    except (ImportError, SystemExit, Exception) as exc:  # mypy absent, or type errors
        if mode == "compiled":
            raise
        print(f"warning: building pure Python (mypyc unavailable: {exc})", file=sys.stderr)
        return []
    if mode == "":
        for ext in exts:
            ext.optional = True  # no working C compiler: the pure modules are used instead
    return list(exts)


setup(ext_modules=ext_modules())
