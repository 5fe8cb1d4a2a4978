"""The client contexts of ``https://`` upstreams (``sidecar/upstream/tls.py``): one per distinct
route ``tls:`` value, kept across a reload that leaves it as it was (its TLS sessions too),
built anew when the value or its files change, and the pools of a dropped one closed."""

from __future__ import annotations

import os
from pathlib import Path

from sidecar.config.tls import RouteTls
from sidecar.upstream.client import UpstreamClient
from sidecar.upstream.tls import TlsContexts
from tests import tlscerts


def test_one_context_per_value_kept_while_unchanged(tmp_path: Path) -> None:
    certs = tlscerts.make(tmp_path)
    a, b = RouteTls(ca_file=certs.ca), RouteTls(ca_file=certs.ca, server_name="api.example")
    contexts = TlsContexts()
    assert contexts.sync([a, a, b]) == []
    ca = contexts.get(a)
    assert contexts.get(RouteTls(ca_file=certs.ca)) is ca  # by value
    assert ca.target("localhost").server_name == "localhost"
    assert contexts.get(b).target("localhost").server_name == "api.example"
    assert ca.target("localhost") is ca.target("localhost")  # one identity per name
    cb = contexts.get(b)
    assert contexts.sync([a]) == [cb]
    assert contexts.get(a) is ca  # a reload that leaves it as it was keeps it


def test_a_changed_value_or_file_builds_a_new_context(tmp_path: Path) -> None:
    certs = tlscerts.make(tmp_path)
    a = RouteTls(ca_file=certs.ca)
    contexts = TlsContexts()
    contexts.sync([a])
    first = contexts.get(a)
    assert contexts.sync([RouteTls(ca_file=certs.other_ca)]) == [first]
    contexts.sync([a])
    second = contexts.get(a)
    assert second is not first
    # the CA bundle rotated in place: the next reload builds the context again
    Path(certs.ca).write_bytes(Path(certs.ca).read_bytes() + Path(certs.other_ca).read_bytes())
    st = os.stat(certs.ca)
    os.utime(certs.ca, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert contexts.sync([a]) == [second]
    assert contexts.get(a) is not second


async def test_the_pools_of_a_dropped_context_are_closed(tmp_path: Path) -> None:
    certs = tlscerts.make(tmp_path)
    a = RouteTls(ca_file=certs.ca)
    client = UpstreamClient()
    client.sync_tls([a])
    target = client.tls.get(a).target("localhost")
    pool = client.pool("127.0.0.1", 1, target)
    plain = client.pool("127.0.0.1", 1)
    assert set(client.stats()) == {"127.0.0.1:1", "127.0.0.1:1 tls localhost"}
    client.sync_tls([])
    assert set(client.stats()) == {"127.0.0.1:1"}
    assert pool._closed and not plain._closed
    client.close()
