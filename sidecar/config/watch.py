"""Config reload: from the file watcher, SIGHUP, and POST /config/reload.

The stdlib has no inotify, so the watcher polls ``stat`` every ``interval`` (0.5 s): the file
(following symlinks) and its directory. That sees an in-place edit (mtime/size), an atomic rename
(inode, directory mtime) and the Kubernetes ConfigMap swap of the ``..data`` symlink (the
resolved path and the directory). As a safety net the content hash is compared every
``hash_every`` seconds whatever stat says. New bytes are loaded once they have stayed the same
for one more poll, so a file rewritten in place in several writes is never loaded half-written
(SIGHUP and POST /config/reload read the file at once, as asked). A reload validates the whole
file first; an invalid file changes nothing that serves traffic.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.config.errors import ConfigError, ConfigIssue
from sidecar.config.model import Config
from sidecar.config.parse import parse_bytes, read_file
from sidecar.config.schema import reload_rules
from sidecar.config.store import ConfigStore

log = logging.getLogger("sidecar.config")


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    version: str
    changed: bool
    errors: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)


# How a reload treats every key of the file, derived from the schema (each key's ``live``,
# declared where the key is, in config/model.py and config/policies.py). "live": the new value
# is in force for the next request (or, for drain_timeout, the next drain; for
# dlq.max_records/max_bytes, the next record stored). "restart": the running process keeps what
# it started with and the key is reported in ``restart_required`` (and logged) until the file
# and the process agree again.
RELOAD_RULES: dict[str, str] = reload_rules(Config)


def _value(config: Config, key: str) -> object:
    value: object = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def needs_restart(old: Config, new: Config) -> list[tuple[str, str]]:
    """Keys whose new value a running process cannot take, as (key, what changed)."""
    out = []
    for key, rule in RELOAD_RULES.items():
        if rule != "restart":
            continue
        before, after = _value(old, key), _value(new, key)
        if before != after:
            shown = f"{before} -> {after}" if key != "upstream_pool" else "changed"
            out.append((key, shown))
    return out


def _read(path: str) -> bytes | OSError:
    try:
        return read_file(path)
    except OSError as exc:
        return exc


class Reloader:
    def __init__(
        self,
        path: str,
        store: ConfigStore,
        apply: Callable[[Config], None],
        on_result: Callable[[ReloadResult], None] | None = None,
    ) -> None:
        self.path = path
        self.store = store
        self._apply = apply
        self._on_result = on_result
        self.restart_required: list[str] = []
        self._lock = asyncio.Lock()
        self._bad_sha: str | None = None
        self._started = store.current  # what the listeners were opened with

    async def reload(self, trigger: str, raw: bytes | None = None) -> ReloadResult:
        """Reload from the file now (SIGHUP, POST /config/reload), or from ``raw``, the bytes
        the watcher saw settle."""
        async with self._lock:
            return await self._reload(trigger, raw)

    async def _reload(self, trigger: str, seen: bytes | None) -> ReloadResult:
        old = self.store.current
        # One read: the bytes parsed are the bytes hashed. Hashing the file again after a
        # failed parse could hash a good file written meanwhile and remember it as bad.
        raw = seen if seen is not None else await asyncio.to_thread(_read, self.path)
        try:
            if isinstance(raw, OSError):
                raise ConfigError(
                    self.path, [ConfigIssue(0, "<file>", f"cannot read: {raw.strerror}")]
                )
            try:
                new = await asyncio.to_thread(parse_bytes, raw, self.path)
            except ConfigError:
                raise
            except Exception as bug:
                # A parser bug, not a verdict on the file: the file is still refused, the
                # last good config keeps serving, and the watcher lives on (one traceback).
                log.exception("config reload (%s): the parser failed", trigger)
                issue = ConfigIssue(0, "<file>", f"the parser failed: {type(bug).__name__}")
                raise ConfigError(self.path, [issue]) from None
            changed = new.sha256 != old.sha256
            if changed:
                self._apply_or_refuse(new, trigger)
        except ConfigError as exc:
            self.store.last_error = "; ".join(exc.lines())
            self._bad_sha = hashlib.sha256(raw).hexdigest() if isinstance(raw, bytes) else None
            log.error(
                "config reload (%s) rejected; the last good config keeps serving: %s",
                trigger,
                self.store.last_error,
            )
            result = ReloadResult(False, old.sha256, False, exc.lines(), self.restart_required)
            self._report(result)
            return result
        if changed:
            log.info(
                "config reloaded (%s): version %s, %d routes",
                trigger,
                new.sha256[:12],
                len(new.routes),
            )
            for key, what in needs_restart(self._started, new):
                log.warning("config change needs a restart to apply: %s: %s", key, what)
            for w in new.warnings:
                log.warning("config: %s", w.render(new.source))
        else:
            self.store.last_error = None
        self._bad_sha = None
        result = ReloadResult(True, new.sha256, changed, [], self.restart_required)
        self._report(result)
        return result

    def _apply_or_refuse(self, new: Config, trigger: str) -> None:
        """Apply a valid config, all or nothing (``apply`` puts back what was live when it
        fails). A failure is a bug, not a verdict on the file, but the file is refused like
        an invalid one: reported, and retried only when it changes."""
        try:
            self._apply(new)
        except Exception as bug:
            log.exception("config reload (%s): applying the config failed", trigger)
            issue = ConfigIssue(0, "<file>", f"applying it failed: {type(bug).__name__}: {bug}")
            raise ConfigError(self.path, [issue]) from None
        # Keep the listeners the process started with; report what needs a restart.
        self.restart_required = [key for key, _ in needs_restart(self._started, new)]

    def _report(self, result: ReloadResult) -> None:
        if self._on_result is not None:
            self._on_result(result)

    # -- the watcher ----------------------------------------------------------------------

    def _fingerprint(self) -> tuple[object, ...]:
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            st = os.stat(self.path)
            fst: tuple[object, ...] = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns)
        except OSError:
            fst = ("missing",)
        try:
            dst = os.stat(directory).st_mtime_ns
        except OSError:
            dst = 0
        return (*fst, dst, os.path.realpath(self.path))

    async def watch(self, interval: float = 0.5, hash_every: float = 5.0) -> None:
        """Run until cancelled: reload when the file or its directory changes, once the file's
        bytes have stayed the same for one more poll. An edit written in several steps (an
        editor or a script rewriting the file in place) is not loaded half-written: the half
        is seen, and replaced by the whole before it has stood for a poll."""
        last = self._fingerprint()
        # The first round always compares hashes: the file may have changed between the load
        # and this task's first run.
        last_hash_check = float("-inf")
        settling: str | None = None  # the hash of new bytes seen at the last poll
        while True:
            await asyncio.sleep(interval)
            fp = self._fingerprint()
            due = time.monotonic() - last_hash_check >= hash_every
            if fp == last and not due and settling is None:
                continue
            last = fp
            last_hash_check = time.monotonic()
            raw = await asyncio.to_thread(_read, self.path)
            # Not a regular file (missing, a directory, a FIFO): the watcher waits for a file,
            # and POST /config/reload or SIGHUP says what is wrong.
            sha = hashlib.sha256(raw).hexdigest() if isinstance(raw, bytes) else None
            if sha is None or sha == self.store.current.sha256 or sha == self._bad_sha:
                settling = None
                continue
            if sha != settling:
                log.info(
                    "config file changed (%s); loading it once it stays the same for %.1fs",
                    sha[:12],
                    interval,
                )
                settling = sha
                continue
            settling = None
            assert isinstance(raw, bytes)
            try:
                await self.reload("file-watch", raw)
            except Exception:
                # A bug applying a config must not end the watcher: logged, and the next
                # edit is still loaded.
                log.exception("config reload (file-watch) failed")
