import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.config.errors import ConfigError
from sidecar.config.parse import parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "sidecar.yaml"


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_text(text, "c.yaml")
    return info.value.lines()


def test_example_config_is_valid_and_inherits_defaults():
    c = parse_file(str(EXAMPLE))
    orders = c.route("orders")
    assert orders is not None
    assert orders.retry.attempts == 4  # overridden
    assert orders.retry.per_try_timeout is None  # inherited: auto
    assert orders.dlq.enabled and orders.dlq.max_replays == 5
    assert orders.match.methods == frozenset({"GET", "POST"})
    assert len(c.sha256) == 64


def test_route_override_changes_only_the_keys_it_names():
    c = parse_text(
        """
version: 1
defaults:
  retry: {attempts: 5, backoff: {strategy: constant, base: 10ms, max: 1s}}
routes:
  - name: a
    upstream: http://127.0.0.1:1
    retry: {backoff: {base: 50ms}}
"""
    )
    r = c.routes[0]
    assert r.retry.attempts == 5
    assert (r.retry.backoff.strategy, r.retry.backoff.base, r.retry.backoff.max) == (
        "constant",
        0.05,
        1.0,
    )


def test_errors_name_line_and_key_path():
    lines = errors_of(
        """version: 1
defaults:
  retry:
    attempts: 0
    backof: {}
routes:
  - name: a
    upstream: http://127.0.0.1:1
  - name: b
    upstream: http://127.0.0.1:1
    retry:
      per_try_timeout: 2
      retry_on: [503, sometimes]
"""
    )
    assert "c.yaml:4: defaults.retry.attempts: must be from 1 to 10, got 0" in lines
    assert any(line.startswith("c.yaml:5: defaults.retry.backof: unknown key") for line in lines)
    assert any(
        line.startswith("c.yaml:12: routes[1].retry.per_try_timeout: expected a duration")
        for line in lines
    )
    assert any(
        line.startswith("c.yaml:13: routes[1].retry.retry_on: unknown retry condition")
        for line in lines
    )


@pytest.mark.parametrize(
    ("snippet", "path", "fragment"),
    [
        (
            "  - name: a\n    upstream: http://h:1\n    timeout: soon\n",
            "routes[0].timeout",
            "duration",
        ),
        (
            "  - name: a\n    match: {path_regex: '(['}\n    upstream: http://h:1\n",
            "routes[0].match.path_regex",
            "invalid regular expression",
        ),
        ("  - name: a\n", "routes[0].upstream", "required"),
        (
            "  - name: a\n    upstream: http://h:1\n  - name: a\n    upstream: http://h:1\n",
            "routes[1].name",
            "duplicate route name",
        ),
        ("  - name: 'has space'\n    upstream: http://h:1\n", "routes[0].name", "letters"),
        ("  - name: a\n    upstream: ftp://h:1\n", "routes[0].upstream", "http://"),
        (
            "  - name: a\n    upstream: http://h:1\n    match: {methods: [FETCH]}\n",
            "routes[0].match.methods",
            "unknown HTTP method",
        ),
        (
            "  - name: a\n    upstream: http://h:1\n    retry: {backoff: {strategy: random}}\n",
            "routes[0].retry.backoff.strategy",
            "must be one of",
        ),
        (
            "  - name: a\n    upstream: http://h:1\n    retry: {non_idempotent: sometimes}\n",
            "routes[0].retry.non_idempotent",
            "must be one of",
        ),
        (
            "  - name: a\n    upstream: http://h:1\n    breaker: {failure_ratio: 2}\n",
            "routes[0].breaker.failure_ratio",
            "at most 1",
        ),
        (
            "  - name: a\n    upstream: http://h:1\n    retry: {max_body_bytes: lots}\n",
            "routes[0].retry.max_body_bytes",
            "size",
        ),
    ],
)
def test_each_kind_of_mistake_is_caught(snippet, path, fragment):
    lines = errors_of("version: 1\nroutes:\n" + snippet)
    assert any(f": {path}: " in line and fragment in line for line in lines), lines


def test_missing_routes_version_and_empty_file():
    assert any("routes: required" in line for line in errors_of("version: 1\n"))
    assert any("version: required" in line for line in errors_of("routes: []\n"))
    assert any("empty" in line for line in errors_of(""))


def test_unknown_top_level_key_and_bad_yaml():
    assert any(
        "c.yaml:2: listn: unknown key" in line for line in errors_of("version: 1\nlistn: x\n")
    )
    lines = errors_of("version: 1\nroutes: [\n")
    assert lines[0].startswith("c.yaml:") and "invalid YAML" in lines[0]


def test_alias_bomb_is_refused_quickly():
    bomb = "a: &a [x,x,x,x,x,x,x,x,x,x]\n"
    prev = "a"
    for i in range(12):
        name = f"b{i}"
        bomb += (
            f"{name}: &{name} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]\n"
        )
        prev = name
    lines = errors_of(bomb)
    assert any("alias bomb" in line for line in lines)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parser_never_crashes_and_always_names_a_path(text):
    try:
        parse_text(text, "f.yaml")
    except ConfigError as exc:
        for line in exc.lines():
            assert line.startswith("f.yaml:")
            assert line.count(": ") >= 2


def test_validate_cli_ok_and_error_format(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "sidecar", "validate", str(EXAMPLE)], capture_output=True, text=True
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "OK: 2 routes"
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: 1\nroutes:\n  - name: a\n    upstream: http://h:1\n    retry: {attempts: 99}\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "sidecar", "validate", str(bad)], capture_output=True, text=True
    )
    assert res.returncode == 1
    assert res.stdout.strip() == f"{bad}:5: routes[0].retry.attempts: must be from 1 to 10, got 99"


def test_version_flag():
    res = subprocess.run(
        [sys.executable, "-m", "sidecar", "--version"], capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.startswith("retry-sidecar ")


def test_upstream_pool_and_workers():
    c = parse_text(
        "version: 1\nupstream_pool: {max_connections: 8, wait_timeout: 50ms, idle_timeout: 2s}\n"
        "workers: 1\nroutes: [{name: a, upstream: 'http://h:1'}]\n"
    )
    assert (c.upstream_pool.max_connections, c.upstream_pool.wait_timeout) == (8, 0.05)
    assert c.upstream_pool.idle_timeout == 2.0 and c.upstream_pool.connect_timeout == 1.0
    lines = errors_of("version: 1\nworkers: 4\nroutes: [{name: a, upstream: 'http://h:1'}]\n")
    assert lines[0].startswith("c.yaml:2: workers: only 1 is supported")


def test_huge_documents_are_refused_before_parsing():
    text = "version: 1\n" + "# filler\n" * 200_000  # ~1.8 MB
    lines = errors_of(text)
    # The size check comes before any YAML work: the refusal is about size, not content.
    assert lines == ["c.yaml:1: <document>: the document is larger than 1048576 bytes"]


def test_stream_idle_timeout_is_inherited_overridden_and_checked():
    c = parse_text(
        """
version: 1
defaults:
  stream_idle_timeout: 90s
routes:
  - {name: a, upstream: "http://h:1"}
  - {name: sse, upstream: "http://h:1", stream_idle_timeout: 10m}
"""
    )
    a, sse = c.route("a"), c.route("sse")
    assert a is not None and sse is not None
    assert (a.stream_idle_timeout, sse.stream_idle_timeout) == (90.0, 600.0)
    plain = parse_text('version: 1\nroutes: [{name: a, upstream: "http://h:1"}]')
    assert plain.routes[0].stream_idle_timeout == 60.0  # nginx's proxy_read_timeout
    assert any(
        "routes[0].stream_idle_timeout" in line
        for line in errors_of(
            'version: 1\nroutes: [{name: a, upstream: "http://h:1", stream_idle_timeout: 0s}]'
        )
    )


STANDARD_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT")


@pytest.mark.parametrize("where", ["match: {methods: [M]}", "idempotency: {methods: [M]}"])
@pytest.mark.parametrize("method", STANDARD_METHODS)
def test_a_standard_method_in_lower_case_is_refused_with_the_fix(method, where):
    """Finding 14: ``methods: [get]`` was taken. Methods are case-sensitive (RFC 9110
    section 9.1): ``get`` is not GET. Refused, naming the line, the key and the fix."""
    for written in (method.lower(), method.capitalize()):
        snippet = where.replace("M", written)
        text = f"version: 1\nroutes:\n  - name: a\n    upstream: http://h:1\n    {snippet}\n"
        key = snippet.split(":")[0]
        (line,) = errors_of(text)
        assert line == (
            f"c.yaml:5: routes[0].{key}.methods: methods are case-sensitive (RFC 9110 section "
            f"9.1): {written!r} is not {method}; write {method}"
        )
    hedge = "hedge: {methods: [get]}"
    (line,) = errors_of(
        f"version: 1\nroutes:\n  - name: a\n    upstream: http://h:1\n    {hedge}\n"
    )
    assert "routes[0].hedge.methods: methods are case-sensitive" in line and "write GET" in line


@pytest.mark.parametrize(
    ("written", "decimal", "binary", "fix"),
    [
        ("1MB", 1_000_000, 1_048_576, "1MiB"),
        ("64KB", 64_000, 65_536, "64KiB"),
        ("2GB", 2_000_000_000, 2_147_483_648, "2GiB"),
        ("64k", 64_000, 65_536, "64KiB"),
        ("1M", 1_000_000, 1_048_576, "1MiB"),
        ("1mb", 1_000_000, 1_048_576, "1MiB"),
        ("10 Kb", 10_000, 10_240, "10KiB"),
    ],
)
def test_a_size_in_decimal_or_bare_units_is_refused_with_both_spellings(
    written, decimal, binary, fix
):
    """Finding 14: ``1MB`` silently meant 1,000,000 bytes, a unit the docs do not list.
    Refused: ``1MB`` is 1,000,000 to some and 1,048,576 to others (nginx's ``1m``)."""
    text = (
        "version: 1\nroutes:\n  - name: a\n    upstream: http://h:1\n"
        f"    retry: {{max_body_bytes: {written}}}\n"
    )
    (line,) = errors_of(text)
    assert line == (
        f"c.yaml:5: routes[0].retry.max_body_bytes: {written!r} is ambiguous ({decimal} or "
        f"{binary} bytes?): write {fix} or {decimal}; sizes take B, KiB, MiB, GiB or none (bytes)"
    )
    ok = text.replace(written, fix)
    assert parse_text(ok).routes[0].retry.max_body_bytes == binary


DEAD = (
    "idempotency is enabled on a route that matches only GET, HEAD: none of them is a guarded "
    "write (idempotency.methods: PATCH, POST), so no request is guarded; remove idempotency "
    "from this route (enabled: false), or add the write methods to match.methods"
)


def test_idempotency_on_a_route_that_matches_only_reads_is_refused_or_warned(tmp_path):
    """Finding 14: idempotency on a route that matches only GET passed ``validate`` (and
    ``explain`` described a POST/PATCH rule for it). Written on the route: an error. From
    ``defaults``: a warning on stderr with the line, the key and the fix; ``explain`` says it
    guards nothing."""
    reads = "    match: {path_prefix: /r, methods: [GET, HEAD]}\n"
    explicit = (
        "version: 1\nroutes:\n  - name: r\n    upstream: http://h:1\n"
        + reads
        + "    idempotency:\n      enabled: true\n"
    )
    assert errors_of(explicit) == [f"c.yaml:7: routes[0].idempotency.enabled: {DEAD}"]
    # Any guarded method the route can receive makes it live.
    assert parse_text(explicit.replace("[GET, HEAD]", "[GET, POST]")).warnings == ()
    assert parse_text(explicit.replace(reads, "")).warnings == ()

    inherited = tmp_path / "inherited.yaml"
    inherited.write_text(
        "version: 1\ndefaults:\n  idempotency: {enabled: true}\nroutes:\n"
        "  - name: r\n    upstream: http://h:1\n"
        + reads
        + "  - name: w\n    upstream: http://h:1\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "sidecar", "validate", str(inherited)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and res.stdout == "OK: 2 routes\n"
    assert res.stderr == (
        f"warning: {inherited}:7: routes[0].match.methods: {DEAD} (inherited from "
        "defaults.idempotency: an error if written on the route)\n"
    )
    explained = subprocess.run(
        [sys.executable, "-m", "sidecar", "explain", str(inherited)],
        capture_output=True,
        text=True,
    )
    assert explained.returncode == 0, explained.stderr
    r, w = explained.stdout.split("route w")
    idem_r = next(line for line in r.splitlines() if line.startswith("  idempotency:"))
    assert idem_r == (
        "  idempotency: enabled, but guards nothing: the route matches only GET, HEAD, none of "
        "PATCH/POST (the key is forwarded)"
    )
    assert "  idempotency: PATCH/POST with an Idempotency-Key reach the app once" in w


def test_a_per_try_timeout_longer_than_the_route_timeout_is_warned(tmp_path):
    """Outside finding (issue 29): ``per_try_timeout: 5s`` on a route with ``timeout: 1s``
    passed ``validate`` silently; it never applies. A warning with the line, the key and the
    fix, at the per_try_timeout in force (the route's, or the inherited one's line)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "version: 1\ndefaults:\n  retry: {per_try_timeout: 3s}\nroutes:\n"
        "  - name: a\n    upstream: http://h:1\n    timeout: 1s\n"
        "    retry: {per_try_timeout: 5s}\n"
        "  - name: b\n    upstream: http://h:1\n    timeout: 2s\n"
        "  - name: c\n    upstream: http://h:1\n    timeout: 3s\n"  # equal: no warning
        "  - name: d\n    upstream: http://h:1\n    timeout: 1s\n"
        "    retry: {per_try_timeout: auto}\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "sidecar", "validate", str(cfg)], capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout == "OK: 4 routes\n", res.stderr
    assert res.stderr.splitlines() == [
        f"warning: {cfg}:8: routes[0].retry.per_try_timeout: per_try_timeout 5s is longer than "
        "the route's timeout 1s, so it never applies: the deadline ends every attempt first "
        "(and no retry follows); write a per_try_timeout below 1s (or auto), or raise timeout",
        f"warning: {cfg}:3: routes[1].retry.per_try_timeout: per_try_timeout 3s is longer than "
        "the route's timeout 2s, so it never applies: the deadline ends every attempt first "
        "(and no retry follows); write a per_try_timeout below 2s (or auto), or raise timeout "
        "(per_try_timeout inherited from defaults.retry)",
    ]
