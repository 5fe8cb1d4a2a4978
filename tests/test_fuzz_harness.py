"""The atheris entry points (bench/fuzz.py) run here on fixed seeds, so the harness cannot rot;
the coverage-guided runs themselves are bounded runs from bench/ (see README)."""

from __future__ import annotations

import pytest

from bench.fuzz import fuzz_config, fuzz_head

CONFIG_SEEDS = [
    b"",
    b"version: 1\nroutes: [{name: a, upstream: 'http://h:1'}]\n",
    b"a: &a [x,x]\nb: [*a,*a]\n",
    b"version: 1\nroutes:\n  - name: a\n    upstream: http://h:1\n    retry: {attempts: '3'}\n",
    b"\xff\xfe\x00garbage: [",
    b"- - - - -\n",
    b"version: !!python/object:os.system 'echo'\n",
]
HEAD_SEEDS = [
    b"/a%2Fb?x\r\nConnection: x-retry-edge, te\r\nx-retry-edge: evil\r\ntracestate: a=b\r\n",
    b"T/\r\nx-request-timeout-ms: 99999999999999999\r\nx-t: y\r\n",
    b"\r\n:\r\n::\r\nA:\r\n",
]


@pytest.mark.parametrize("seed", CONFIG_SEEDS)
def test_config_harness_on_seeds(seed):
    fuzz_config(seed)


@pytest.mark.parametrize("seed", HEAD_SEEDS)
def test_head_harness_on_seeds(seed):
    fuzz_head(seed)
