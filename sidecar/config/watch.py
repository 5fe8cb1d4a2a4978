"""Config reload: from the file watcher, SIGHUP, and POST /config/reload.

The stdlib has no inotify, so the watcher polls ``stat`` every ``interval`` (0.5 s): the file
(following symlinks) and its directory. That sees an in-place edit (mtime/size), an atomic rename
(inode, directory mtime) and the Kubernetes ConfigMap swap of the ``..data`` symlink (the
resolved path and the directory). As a safety net the content hash is compared every
``hash_every`` seconds whatever stat says. New bytes are loaded once they (and the file's stat)
have stayed the same: for ``SETTLE`` (2 s) when the file was rewritten in place, so a writer
pausing less than that between two writes is never loaded half-written; for one more poll when
a rename or symlink swap put a new file there, whole when it appears (SIGHUP and POST
/config/reload read the file at once, as asked). A reload validates the whole
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


# How long bytes rewritten in place (the same file, ``cat > f``, ``echo >> f``, a script's
# writes) must stay the same, stat included, before the watcher loads them: a writer that pauses
# between two writes for less than this is never loaded half-written. No window covers every
# pause; a file replaced by a rename (``mv``, ``sed -i``, most editors, the ConfigMap
# ``..data`` swap) is whole the moment it appears, and is loaded after one poll.
SETTLE = 2.0


@dataclass(frozen=True, slots=True)
class Pending:
    """New bytes the watcher saw, not loaded yet: their hash, the file's stat with them, and
    since when (monotonic) both have stayed the same."""

    sha: str
    stat: tuple[object, ...]
    since: float


def settle_step(
    pending: Pending | None,
    sha: str,
    stat: tuple[object, ...],
    now: float,
    wait: float,
) -> tuple[Pending, bool]:
    """One poll's verdict on new bytes: what is pending after it, and whether to load them
    now (they and the stat have stayed the same for ``wait`` seconds). Pure: the clock is
    passed in. Any change of the bytes or the stat starts the wait again."""
    if pending is None or pending.sha != sha or pending.stat != stat:
        return Pending(sha, stat, now), False
    return pending, now - pending.since >= wait


def settle_wait(loaded: tuple[object, ...], stat: tuple[object, ...], settle: float) -> float:
    """How long new bytes must stay the same: ``settle`` for the file last loaded rewritten
    in place (its inode and resolved path unchanged); nothing beyond the next poll's look
    for a file put there by a rename or a symlink swap, whole when it appears. ``loaded``
    and ``stat`` are fingerprints (inode first, resolved path last)."""
    replaced = (loaded[0], loaded[-1]) != (stat[0], stat[-1])
    return 0.0 if replaced else settle


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

    async def _back_to_current(self, sha: str) -> None:
        """The file holds the config in force again (a bad edit put back): a failed reload
        is no longer the state of things, so its error is cleared and the reload reported
        good. Nothing is applied: what serves is already these bytes."""
        async with self._lock:
            if self.store.last_error is None or sha != self.store.current.sha256:
                return
            self.store.last_error = None
            self._bad_sha = None
            log.info(
                "config reload failure cleared: the file is back to the config in force (%s)",
                sha[:12],
            )
            self._report(ReloadResult(True, sha, False, [], self.restart_required))

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

    async def watch(
        self, interval: float = 0.5, hash_every: float = 5.0, settle: float = SETTLE
    ) -> None:
        """Run until cancelled: reload when the file or its directory changes, once the new
        bytes and the file's stat have stayed the same long enough (``settle_wait``): ``settle``
        seconds for a file rewritten in place, one poll for one replaced by a rename. A writer
        pausing less than ``settle`` between two in-place writes is not loaded half-written;
        one pausing longer can be (docs/operating.md, "Hot reload": write elsewhere and rename)."""
        last = self._fingerprint()
        loaded = last  # the file whose bytes serve: in place or replaced is judged against it
        # The first round always compares hashes: the file may have changed between the load
        # and this task's first run.
        last_hash_check = float("-inf")
        pending: Pending | None = None
        while True:
            await asyncio.sleep(interval)
            fp = self._fingerprint()
            due = time.monotonic() - last_hash_check >= hash_every
            if fp == last and not due and pending is None:
                continue
            last = fp
            last_hash_check = time.monotonic()
            raw = await asyncio.to_thread(_read, self.path)
            # Not a regular file (missing, a directory, a FIFO): the watcher waits for a file,
            # and POST /config/reload or SIGHUP says what is wrong.
            sha = hashlib.sha256(raw).hexdigest() if isinstance(raw, bytes) else None
            if sha is None or sha == self.store.current.sha256 or sha == self._bad_sha:
                pending = None
                if sha is not None:
                    loaded = fp
                if sha == self.store.current.sha256:
                    await self._back_to_current(sha)
                continue
            fp = self._fingerprint()  # the stat that goes with the bytes just read
            wait = settle_wait(loaded, fp, settle)
            before = pending
            pending, ready = settle_step(pending, sha, fp, time.monotonic(), wait)
            if not ready:
                if pending is not before:  # new bytes or a new stat: the wait starts
                    log.info(
                        "config file changed (%s); loading it once it stays the same for %.1fs",
                        sha[:12],
                        max(wait, interval),
                    )
                continue
            pending = None
            loaded = fp
            assert isinstance(raw, bytes)
            try:
                await self.reload("file-watch", raw)
            except Exception:
                # A bug applying a config must not end the watcher: logged, and the next
                # edit is still loaded.
                log.exception("config reload (file-watch) failed")
