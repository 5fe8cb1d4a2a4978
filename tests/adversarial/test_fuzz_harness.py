"""The atheris entry points (bench/fuzz.py) run here on fixed seeds, so the harness cannot rot;
the coverage-guided runs themselves are bounded runs from bench/ (see docs/hardening.md)."""

from __future__ import annotations

import pytest

from bench.fuzz import fuzz_config, fuzz_head

CONFIG_SEEDS = [
    (b"version: 1\nroutes: [{name: a, upstream: 'http://h:1'}]\n", None),
    (b"", "the file is empty"),
    (b"a: &a [x,x]\nb: [*a,*a]\n", "unknown key"),
    (
        b"version: 1\nroutes:\n  - name: a\n    upstream: http://h:1\n    retry: {attempts: '3'}\n",
        "routes[0].retry.attempts",
    ),
    (b"\xff\xfe\x00garbage: [", "invalid YAML"),
    (b"- - - - -\n", "expected a mapping"),
    (b"version: !!python/object:os.system 'echo'\n", "fuzz.yaml:1: version: unsupported value"),
]
HEAD_SEEDS = [
    b"/a%2Fb?x\r\nConnection: x-retry-edge, te\r\nx-retry-edge: evil\r\ntracestate: a=b\r\n",
    b"T/\r\nx-request-timeout-ms: 99999999999999999\r\nx-t: y\r\n",
    b"\r\n:\r\n::\r\nA:\r\n",
]


@pytest.mark.parametrize(("seed", "fragment"), CONFIG_SEEDS)
def test_config_harness_on_seeds(seed, fragment):
    lines = fuzz_config(seed)
    if fragment is None:
        assert lines == []
    else:
        assert any(fragment in line for line in lines), lines


@pytest.mark.parametrize("seed", HEAD_SEEDS)
def test_head_harness_on_seeds(seed):
    out = fuzz_head(seed)
    names = [k.lower() for k, _ in out]
    assert b"x-retry-edge" not in names and b"te" not in names
    assert names.count(b"x-forwarded-for") == 1
