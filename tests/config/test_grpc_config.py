"""The config of HTTP/2 upstreams and gRPC calls: ``upstream_protocol``, the gRPC words of
``retry_on``, POST in ``hedge.methods``, and the warning for a gRPC route without h2."""

from __future__ import annotations

import pytest

from sidecar.config.errors import ConfigError
from sidecar.config.parse import parse_text
from sidecar.outcomes import GRPC_RETRY_ON

HEAD = "version: 1\nroutes:\n  - name: r\n    upstream: http://127.0.0.1:1\n"


def route(extra: str = "") -> str:
    return HEAD + "".join(f"    {line}\n" for line in extra.splitlines())


@pytest.mark.parametrize("value", ["http1", "h2", "auto"])
def test_upstream_protocol_takes_its_three_words(value: str) -> None:
    assert parse_text(route(f"upstream_protocol: {value}")).routes[0].upstream_protocol == value


def test_upstream_protocol_is_http1_unless_said() -> None:
    assert parse_text(route()).routes[0].upstream_protocol == "http1"


@pytest.mark.parametrize("value", ["http2", "h2c", "HTTP1", "true", "2"])
def test_any_other_upstream_protocol_is_refused_naming_the_words(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_text(route(f"upstream_protocol: {value}"))
    assert "http1, h2, auto" in str(err.value)


def test_the_default_retry_on_retries_unavailable_only_of_the_grpc_statuses() -> None:
    on = parse_text(route()).routes[0].retry.retry_on
    assert on.grpc == {GRPC_RETRY_ON["unavailable"]}


def test_each_grpc_word_is_its_code_and_a_list_without_them_retries_no_grpc_status() -> None:
    for word, code in GRPC_RETRY_ON.items():
        on = parse_text(route(f"retry: {{retry_on: [{word}]}}")).routes[0].retry.retry_on
        assert on.grpc == {code} and not on.statuses and not on.kinds
    on = parse_text(route("retry: {retry_on: [connect-failure, 503]}")).routes[0].retry.retry_on
    assert on.grpc == frozenset()


def test_an_unknown_word_is_refused_naming_the_grpc_words_too() -> None:
    with pytest.raises(ConfigError) as err:
        parse_text(route("retry: {retry_on: [unavailble]}"))
    assert "unavailable" in str(err.value) and "resource-exhausted" in str(err.value)


def test_post_may_be_hedged_other_writes_may_not() -> None:
    methods = parse_text(route("hedge: {enabled: true, methods: [GET, POST]}")).routes[0]
    assert "POST" in methods.hedge.methods
    for write in ("PATCH", "LOCK"):
        with pytest.raises(ConfigError):
            parse_text(route(f"hedge: {{methods: [GET, {write}]}}"))


def test_a_route_matching_grpc_calls_without_h2_is_warned_about() -> None:
    grpc = "match: {headers: {content-type: application/grpc+proto}}"
    (warning,) = parse_text(route(grpc)).warnings
    assert warning.path == "routes[0].match.headers" and "upstream_protocol: h2" in warning.message
    assert parse_text(route(grpc + "\nupstream_protocol: h2")).warnings == ()
    assert parse_text(route("match: {headers: {content-type: text/plain}}")).warnings == ()
