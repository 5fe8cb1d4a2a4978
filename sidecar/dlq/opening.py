"""A DLQ file opened in a worker thread, which closes it there again when the one who asked
for it has left (a shutdown during the opening).

The opening may wait on a lock for seconds; a stop does not wait for it. Closing what it opened
from a done-callback on the event loop needs the loop to outlive the thread, which a stopping
process's loop does not: the writer thread would be left running. So the thread itself closes
the store when it finds its opener gone; a lock decides who closes it when both finish at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound="Closable")


class Opening(Generic[T]):
    """Call it in the worker thread; ``abandon`` it from the opener."""

    def __init__(self, open_store: Callable[[], T | None]) -> None:
        self._open = open_store
        self._lock = threading.Lock()
        self._abandoned = False
        self._delivered = False

    def __call__(self) -> T | None:
        store = self._open()
        with self._lock:
            if self._abandoned:
                if store is not None:
                    store.close()
                return None
            self._delivered = True
            return store

    def abandon(self) -> bool:
        """The opener leaves. True when the thread had already handed its store over: then
        the opener closes it (it is the thread's result)."""
        with self._lock:
            self._abandoned = True
            return self._delivered


def close_opened(fut: asyncio.Future[T | None]) -> None:
    """The store a finished opening handed over, closed (its opener has left)."""
    if not fut.cancelled() and fut.exception() is None:
        store = fut.result()
        if store is not None:
            store.close()


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run on ``loop``, for a call made from another thread (the DLQ's writer)."""

    def call() -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to count on
            loop.call_soon_threadsafe(fn)

    return call
