"""Coverage-guided fuzzing with atheris (PyPI) of the config parser and the request-head
handling, for a bounded time. What it finds becomes a regression test beside the fixed seeds
of tests/adversarial/test_fuzz_harness.py.

    python3 -m bench.fuzz config --seconds 60
    python3 -m bench.fuzz head --seconds 60
"""

from __future__ import annotations

import argparse
import sys
import time

TARGETS = ("config", "head")


def fuzz_config(data: bytes) -> list[str]:
    """The rejection lines (empty when the document is valid)."""
    from sidecar.config.errors import ConfigError
    from sidecar.config.parse import parse_text

    text = data.decode("utf-8", "replace")
    try:
        parse_text(text, "fuzz.yaml")
    except ConfigError as exc:
        for line in exc.lines():
            # Every rejection names the file, a line and a key path.
            assert line.startswith("fuzz.yaml:"), line
            assert line.count(": ") >= 2, line
        return exc.lines()
    return []


def fuzz_head(data: bytes) -> list[tuple[bytes, bytes]]:
    """The pure part of request-head handling: header rules and routing on arbitrary bytes."""
    from sidecar.engine import head
    from sidecar.proxy import forward
    from sidecar.proxy.routing import find_route

    lines = data.split(b"\r\n")
    target = lines[0].decode("latin-1") if lines else "/"
    headers = []
    for line in lines[1:40]:
        name, sep, value = line.partition(b":")
        if sep:
            headers.append((name.strip(), value.strip()))
    out, _edge, _timeout = forward.request_headers(
        headers, "127.0.0.1", trusted=bool(data[:1] == b"T")
    )
    for k, _ in out:
        assert k.lower() not in forward.HOP_BY_HOP
    head.edge_head("GET", target, out, b"fuzz")
    forward.response_headers(headers)
    hmap = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
    find_route(_routes(), "GET", target.split("?", 1)[0], hmap.get)
    return out


_CACHE: list[object] = []


def _routes():  # type: ignore[no-untyped-def]
    """Built on first use, after atheris has instrumented the modules."""
    if _CACHE:
        return _CACHE[0]
    from sidecar.config.parse import parse_text

    _CACHE.append(
        parse_text(
            "version: 1\nroutes:\n"
            "  - {name: a, upstream: 'http://h:1', match: {path_regex: '/v[0-9]+/.*'}}\n"
            "  - {name: b, upstream: 'http://h:1', match: {headers: {x-t: y}, path_prefix: /b}}\n"
            "  - {name: c, upstream: 'http://h:1'}\n"
        ).routes
    )
    return _CACHE[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("target", choices=TARGETS)
    ap.add_argument("--seconds", type=int, default=60)
    args = ap.parse_args()
    try:
        import atheris
    except ImportError:
        print("atheris is not installed: pip install atheris", file=sys.stderr)
        return 2
    fn = fuzz_config if args.target == "config" else fuzz_head
    started = time.monotonic()
    with atheris.instrument_imports():
        import sidecar.config.parse
        import sidecar.proxy.forward
        import sidecar.proxy.routing  # noqa: F401
    atheris.Setup([sys.argv[0], f"-max_total_time={args.seconds}", "-rss_limit_mb=2048"], fn)
    atheris.Fuzz()
    print(f"fuzzed {args.target} for {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
