"""The TLS keys as `validate` and a reload read them: the files exist, parse and match, each
problem named by its key path and line; https:// upstreams take port 443 unless given."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config.errors import ConfigError
from sidecar.config.parse import parse_text
from sidecar.config.tls import cert_info, client_context, server_context
from tests import tlscerts


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tlscerts.CertSet:
    return tlscerts.make(tmp_path_factory.mktemp("tls"))


def problems(text: str) -> list[str]:
    try:
        parse_text(text, "c.yaml")
    except ConfigError as e:
        return e.lines()
    return []


def test_https_upstreams_default_to_443_and_keep_their_scheme() -> None:
    config = parse_text(
        'version: 1\nroutes:\n  - {name: a, upstream: ["https://api.example.com", '
        '"https://127.0.0.1:8443", "http://127.0.0.1:8080"]}\n',
        "c.yaml",
    )
    ups = config.routes[0].upstreams
    assert [(u.host, u.port, u.tls, str(u)) for u in ups] == [
        ("api.example.com", 443, True, "https://api.example.com:443"),
        ("127.0.0.1", 8443, True, "https://127.0.0.1:8443"),
        ("127.0.0.1", 8080, False, "http://127.0.0.1:8080"),
    ]
    tls = config.routes[0].tls
    assert (tls.verify, tls.ca_file, tls.min_version) == (True, None, "1.2")


def test_each_bad_file_is_named_by_key_and_line(made: tlscerts.CertSet, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    text = f"""version: 1
server_tls:
  cert_file: {made.server.cert}
  key_file: {made.client.key}
  client_ca_file: {junk}
defaults:
  tls: {{ca_file: {made.ca}}}
routes:
  - name: a
    upstream: https://localhost:8443
    tls:
      client_cert: {made.client.cert}
  - name: b
    upstream: https://localhost:8443
    tls:
      ca_file: {tmp_path / "gone.pem"}
"""
    found = problems(text)
    assert any(p.startswith("c.yaml:4: server_tls.key_file:") and "match" in p for p in found)
    assert any(p.startswith("c.yaml:5: server_tls.client_ca_file:") for p in found), found
    assert any("routes[0].tls.client_key: client_cert and client_key" in p for p in found)
    assert any(p.startswith("c.yaml:16: routes[1].tls.ca_file: cannot read") for p in found)
    assert len(found) == 4, found


def test_a_key_without_its_certificate_and_a_client_ca_without_a_listener() -> None:
    found = problems(
        "version: 1\nserver_tls: {key_file: /k.pem, client_ca_file: /ca.pem}\n"
        "routes: [{name: a, upstream: 'http://127.0.0.1:1'}]\n"
    )
    assert any("server_tls.cert_file: cert_file and key_file" in p for p in found), found


def test_good_files_make_contexts_and_say_what_they_hold(made: tlscerts.CertSet) -> None:
    text = f"""version: 1
server_tls: {{cert_file: {made.server.cert}, key_file: {made.server.key}, client_ca_file: {made.ca}}}
routes:
  - name: a
    upstream: https://localhost:8443
    tls: {{ca_file: {made.ca}, client_cert: {made.client.cert}, client_key: {made.client.key}}}
"""
    config = parse_text(text, "c.yaml")
    assert config.server_tls.enabled
    server = server_context(config.server_tls)
    assert server.verify_mode.name == "CERT_REQUIRED"
    client = client_context(config.routes[0].tls)
    assert client.check_hostname and client.verify_mode.name == "CERT_REQUIRED"
    info = cert_info(made.server.cert)
    assert info.not_after > 2e9 and "trustme" in info.subject
    assert cert_info(made.expired.cert).not_after < 1e9


def test_an_encrypted_key_is_refused_without_a_prompt(made: tlscerts.CertSet) -> None:
    """OpenSSL asks a terminal for the passphrase of an encrypted key, which would block the
    event loop (or validate) until someone typed it: refused at once instead, by its key."""
    import subprocess

    enc = made.dir / "client-encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", made.client.key, "-aes256", "-passout", "pass:x", "-out", enc],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    text = f"""version: 1
routes:
  - name: a
    upstream: https://localhost:8443
    tls: {{client_cert: {made.client.cert}, client_key: {enc}}}
"""
    found = problems(text)
    assert len(found) == 1 and "routes[0].tls.client_key" in found[0], found
    assert "the key is encrypted" in found[0]


@pytest.mark.parametrize("name", ["*.example.com", "api example", "host:443", ".example.com"])
def test_server_name_is_a_host_name_never_a_pattern(name: str) -> None:
    found = problems(
        f'version: 1\nroutes: [{{name: a, upstream: "https://10.0.0.1", tls: {{server_name: "{name}"}}}}]\n'
    )
    assert any("routes[0].tls.server_name: expected a host name" in p for p in found), found
