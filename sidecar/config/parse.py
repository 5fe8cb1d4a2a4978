"""YAML text -> ``Config``. Every problem is collected with its key path and line.

A generic walker over the schema (``schema.entries``) parses every section: each key is checked
by the check its field declares, where it is written, so an error points at the line that holds
it. Routes inherit ``defaults``; a route overrides any key, section by section
(``retry: {attempts: 4}`` changes only ``attempts``). Only ``match``'s headers, the routes list
and the kill switches have code of their own here.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import MISSING
from typing import Any

from sidecar.config import checks, dlqfile, fleet, idempotency, killswitches, schema, units
from sidecar.config.errors import ConfigError, ConfigIssue
from sidecar.config.model import Config, Match, Route
from sidecar.config.yamlnodes import (
    MAX_DOCUMENT_BYTES,
    Located,
    Path,
    YamlLoadError,
    load,
    path_str,
)

# What a route inherits: every key of a route but its name, match and upstream.
INHERITED = tuple(e for e in schema.entries(Route) if e.default is not MISSING)
ROUTE_SECTIONS = tuple(e.name for e in INHERITED)


class _Parser:
    def __init__(self, located: Located) -> None:
        self.located = located
        self.issues: list[ConfigIssue] = []
        self.warnings: list[ConfigIssue] = []

    def error(self, path: Path, message: str) -> None:
        self.issues.append(ConfigIssue(self.located.line(path), path_str(path), message))

    def mapping(self, value: object, path: Path, allowed: tuple[str, ...]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.error(path, f"expected a mapping, got {checks.kind(value)}")
            return {}
        for key in value:
            if key not in allowed:
                self.error((*path, key), f"unknown key (allowed: {', '.join(allowed)})")
        return {k: v for k, v in value.items() if k in allowed}

    def walk(
        self,
        entries: tuple[schema.Entry, ...],
        raw: dict[str, Any],
        path: Path,
        base: dict[str, Any],
    ) -> dict[str, Any]:
        """The values of ``entries`` (by attribute): those written in ``raw``, checked, over
        ``base``; a problem is reported and leaves the base value."""
        out = dict(base)
        for e in entries:
            if e.name not in raw:
                if e.key.required:
                    self.error((*path, e.name), e.key.required)
                continue
            if e.section is not None:
                out[e.attr] = self.section(e.section, raw[e.name], (*path, e.name), base[e.attr])
                continue
            assert e.key.check is not None
            try:
                out[e.attr] = e.key.check(raw[e.name])
            except (checks.Invalid, units.UnitError) as exc:
                self.error((*path, e.name), str(exc))
        return out

    def section(self, cls: type, value: object, path: Path, base: object) -> Any:
        entries = tuple(schema.entries(cls))
        raw = self.mapping(value, path, tuple(e.name for e in entries))
        start = {e.attr: getattr(base, e.attr) for e in entries}
        result = cls(**self.walk(entries, raw, path, start))
        settle = schema.rule_of(cls)
        if settle is not None:
            result, problems = settle(result, raw.keys())
            for name, message in problems:
                self.error((*path, name), message)
        return result

    def match(self, value: object, path: Path) -> Match:
        entries = tuple(schema.entries(Match))
        raw = self.mapping(value, path, tuple(e.name for e in entries))
        plain = tuple(e for e in entries if not e.key.own)
        values = self.walk(plain, raw, path, schema.defaults(Match))
        if "headers" in raw:
            hraw = raw["headers"]
            if not isinstance(hraw, dict):
                self.error((*path, "headers"), "expected a mapping of header name to exact value")
            else:
                pairs = []
                for name, val in hraw.items():
                    if not isinstance(val, str | int) or isinstance(val, bool):
                        self.error((*path, "headers", name), "expected a string value")
                        continue
                    pairs.append((str(name).lower(), str(val)))
                values["headers"] = tuple(pairs)
        return Match(**values)

    def config(self, source: str, sha: str) -> Config | None:
        data = self.located.data
        if data is None:
            self.error((), "the file is empty")
            return None
        entries = tuple(schema.entries(Config))
        top = self.mapping(data, (), (*(e.name for e in entries), "defaults"))
        plain = tuple(e for e in entries if not e.key.own)
        values = self.walk(plain, top, (), schema.defaults(Config))
        defaults = self.walk(
            INHERITED,
            self.mapping(top.get("defaults"), ("defaults",), ROUTE_SECTIONS),
            ("defaults",),
            schema.defaults(Route),
        )
        for name, message in fleet.storage_problems(values["idempotency"], values["fleet"]):
            self.error(("idempotency", name), message)
        for name, message in dlqfile.dlq_problems(values["dlq"], values["fleet"]):
            self.error(("dlq", name), message)
        routes = self.routes(top.get("routes"), defaults)
        switches = killswitches.parse_section(
            top.get("killswitches"), self.located, {r.name for r in routes}, self.error
        )
        if self.issues:
            return None
        values.update(
            routes=tuple(routes),
            killswitches=switches,
            source=source,
            sha256=sha,
            warnings=tuple(self.warnings),
        )
        return Config(**values)

    def routes(self, value: object, defaults: dict[str, Any]) -> list[Route]:
        if value is None:
            self.error(("routes",), "required: at least one route")
            return []
        if not isinstance(value, list):
            self.error(("routes",), f"expected a list of routes, got {checks.kind(value)}")
            return []
        if not value:
            self.error(("routes",), "at least one route is required")
        identity = tuple(e for e in schema.entries(Route) if e.default is MISSING and not e.key.own)
        routes: list[Route] = []
        seen: dict[str, int] = {}
        for i, item in enumerate(value):
            path: Path = ("routes", i)
            raw = self.mapping(item, path, schema.names(Route))
            if not isinstance(item, dict):
                continue
            values = self.walk(identity, raw, path, {})
            name = values.get("name")
            if name in seen:
                self.error((*path, "name"), f"duplicate route name (also routes[{seen[name]}])")
            elif name is not None:
                seen[name] = i
            values["match"] = self.match(raw.get("match"), (*path, "match"))
            values.update(self.walk(INHERITED, raw, path, defaults))
            if "name" in values and "upstreams" in values:
                routes.append(Route(**values))
                self.dead_guard(routes[-1], raw, path)
                self.slow_try(routes[-1], raw, path)
                self.unverified(routes[-1], raw, path)
                self.grpc_without_h2(routes[-1], path)
        return routes

    def grpc_without_h2(self, route: Route, path: Path) -> None:
        """A warning for a route that matches gRPC calls (``content-type: application/grpc``
        in ``match.headers``) but speaks HTTP/1.1 to its upstream: every call it matches is
        answered UNAVAILABLE."""
        grpc = any(
            k.lower() == "content-type" and v.strip().lower().startswith("application/grpc")
            for k, v in route.match.headers
        )
        if not grpc or route.upstream_protocol == "h2":
            return
        where = (*path, "match", "headers")
        why = (
            "this route matches gRPC calls (content-type: application/grpc) but its "
            f"upstream_protocol is {route.upstream_protocol}: every call is answered "
            "UNAVAILABLE; give it upstream_protocol: h2"
        )
        self.warnings.append(ConfigIssue(self.located.line(where), path_str(where), why))

    def unverified(self, route: Route, raw: dict[str, Any], path: Path) -> None:
        """A warning, at the line of the ``verify: false`` in force, for a route whose
        ``https://`` upstreams are not verified."""
        if route.tls.verify or not any(u.tls for u in route.upstreams):
            return
        tls = raw.get("tls")
        here = isinstance(tls, dict) and "verify" in tls
        where = (*path, "tls", "verify")
        line = self.located.line(where if here else ("defaults", "tls", "verify"))
        why = (
            "verify: false: the https:// upstream's certificate is not verified, so anyone on "
            "the path can answer for it; give tls.ca_file (or server_name) instead"
        )
        self.warnings.append(ConfigIssue(line, path_str(where), why))

    def slow_try(self, route: Route, raw: dict[str, Any], path: Path) -> None:
        """A warning, at the line of the per_try_timeout in force (the route's, or the one
        it inherits from ``defaults``), when it is longer than the route's timeout."""
        why = checks.per_try_beyond_timeout(route.retry.per_try_timeout, route.timeout)
        if why is None:
            return
        retry = raw.get("retry")
        written_here = isinstance(retry, dict) and "per_try_timeout" in retry
        where = (*path, "retry", "per_try_timeout")
        line = self.located.line(
            where if written_here else ("defaults", "retry", "per_try_timeout")
        )
        if not written_here:
            why += " (per_try_timeout inherited from defaults.retry)"
        self.warnings.append(ConfigIssue(line, path_str(where), why))

    def dead_guard(self, route: Route, raw: dict[str, Any], path: Path) -> None:
        """Idempotency on a route that matches none of its guarded methods: an error where
        the route itself enables it, a warning where it comes from ``defaults`` (enabled for
        every route, this one only reads)."""
        why = idempotency.dead_guard(route.idempotency, route.match.methods)
        if why is None:
            return
        if "idempotency" in raw:
            self.error((*path, "idempotency", "enabled"), why)
        else:
            where = (*path, "match", "methods")
            why += " (inherited from defaults.idempotency: an error if written on the route)"
            self.warnings.append(ConfigIssue(self.located.line(where), path_str(where), why))


# -- entry points -------------------------------------------------------------------------------


def parse_text(text: str, source: str = "<memory>") -> Config:
    """Parse and validate; raise ConfigError listing every problem found."""
    sha = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    try:
        located = load(text)
    except YamlLoadError as exc:
        raise ConfigError(source, [ConfigIssue(exc.line, exc.path, exc.message)]) from None
    parser = _Parser(located)
    config = parser.config(source, sha)
    if config is None:
        raise ConfigError(source, parser.issues)
    return config


def read_file(path: str) -> bytes:
    """The config file's bytes, at most one more than the document limit: a regular file only.

    Opened non-blocking, so that a FIFO put where the file was (which open() would wait on
    for a writer forever, holding the reload lock and a thread) or a device (/dev/zero,
    read forever) is refused at once; a larger file is not read past the limit."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a directory, FIFO, socket or device)")
        return f.read(MAX_DOCUMENT_BYTES + 1)


def parse_file(path: str) -> Config:
    try:
        raw = read_file(path)
    except OSError as exc:
        raise ConfigError(
            path, [ConfigIssue(0, "<file>", f"cannot read: {exc.strerror}")]
        ) from None
    return parse_bytes(raw, path)


def parse_bytes(raw: bytes, path: str) -> Config:
    """The file's bytes as read once: the version (sha256) is of exactly these bytes."""
    if len(raw) > MAX_DOCUMENT_BYTES:  # checked before decoding: the read stops past it
        raise ConfigError(
            path, [ConfigIssue(1, "<file>", f"the file is larger than {MAX_DOCUMENT_BYTES} bytes")]
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(path, [ConfigIssue(1, "<file>", "the file is not UTF-8")]) from None
    return parse_text(text, source=path)
