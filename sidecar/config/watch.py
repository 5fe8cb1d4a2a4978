"""Config reload: from the file watcher, SIGHUP, and POST /config/reload.

The stdlib has no inotify, so the watcher polls ``stat`` every ``interval`` (0.5 s): the file
(following symlinks) and its directory. That sees an in-place edit (mtime/size), an atomic rename
(inode, directory mtime) and the Kubernetes ConfigMap swap of the ``..data`` symlink (the
resolved path and the directory). As a safety net the content hash is compared every
``hash_every`` seconds whatever stat says. A reload validates the whole file first; an invalid
file changes nothing that serves traffic.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.config.errors import ConfigError
from sidecar.config.model import Config
from sidecar.config.parse import parse_file
from sidecar.config.store import ConfigStore

log = logging.getLogger("sidecar.config")


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    version: str
    changed: bool
    errors: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)


def needs_restart(old: Config, new: Config) -> list[str]:
    """Settings a running process cannot change; they are reported, not half-applied."""
    out = []
    if old.listen != new.listen:
        out.append(f"listen: {old.listen} -> {new.listen} (restart to apply)")
    if old.admin.listen != new.admin.listen:
        out.append(f"admin.listen: {old.admin.listen} -> {new.admin.listen} (restart to apply)")
    if old.admin.token_env != new.admin.token_env:
        out.append("admin.token_env changed (restart to apply)")
    if old.limits.keepalive_timeout != new.limits.keepalive_timeout:
        out.append("limits.keepalive_timeout changed (restart to apply)")
    if old.upstream_pool != new.upstream_pool:
        out.append("upstream_pool changed (restart to apply)")
    if old.dlq.path != new.dlq.path:
        out.append(f"dlq.path: {old.dlq.path} -> {new.dlq.path} (restart to apply)")
    return out


def file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


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

    async def reload(self, trigger: str) -> ReloadResult:
        async with self._lock:
            return await self._reload(trigger)

    async def _reload(self, trigger: str) -> ReloadResult:
        old = self.store.current
        try:
            new = await asyncio.to_thread(parse_file, self.path)
        except ConfigError as exc:
            self.store.last_error = "; ".join(exc.lines())
            self._bad_sha = file_sha256(self.path)
            log.error(
                "config reload (%s) rejected; the last good config keeps serving: %s",
                trigger,
                self.store.last_error,
            )
            result = ReloadResult(False, old.sha256, False, exc.lines(), self.restart_required)
            self._report(result)
            return result
        changed = new.sha256 != old.sha256
        if changed:
            # Keep the listeners the process started with; report what needs a restart.
            self.restart_required = needs_restart(self._started, new)
            self._apply(new)
            log.info(
                "config reloaded (%s): version %s, %d routes",
                trigger,
                new.sha256[:12],
                len(new.routes),
            )
            for r in self.restart_required:
                log.warning("config change needs a restart: %s", r)
        else:
            self.store.last_error = None
        self._bad_sha = None
        result = ReloadResult(True, new.sha256, changed, [], self.restart_required)
        self._report(result)
        return result

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
        """Run until cancelled: reload when the file or its directory changes."""
        last = self._fingerprint()
        # The first round always compares hashes: the file may have changed between the load
        # and this task's first run.
        last_hash_check = float("-inf")
        while True:
            await asyncio.sleep(interval)
            fp = self._fingerprint()
            due = time.monotonic() - last_hash_check >= hash_every
            if fp == last and not due:
                continue
            last = fp
            last_hash_check = time.monotonic()
            sha = await asyncio.to_thread(file_sha256, self.path)
            if sha is None or sha == self.store.current.sha256 or sha == self._bad_sha:
                continue
            await self.reload("file-watch")
