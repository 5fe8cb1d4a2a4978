"""A WSGI middleware that counts the requests an app handled, by a key the app's test picks,
and the statuses it answered; ``GET /__count`` (never passed to the app) returns both as JSON.
It lives in the app's process, so the count is the app's own, whatever proxy is in front."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

COUNT_PATH = "/__count"


class Counting:
    def __init__(self, app: WsgiApp, key: Callable[[dict[str, Any]], str]) -> None:
        self.app = app
        self.key = key
        self.handled: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == COUNT_PATH:
            with self.lock:
                doc = {"handled": dict(self.handled), "statuses": dict(self.statuses)}
            body = json.dumps(doc).encode()
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            )
            return [body]
        with self.lock:
            self.handled[self.key(environ)] += 1

        def counted(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            with self.lock:
                self.statuses[status.split(" ", 1)[0]] += 1
            return start_response(status, headers, *exc)

        return self.app(environ, counted)


def read_count(port: int) -> dict[str, dict[str, int]]:
    """The counts of the app on ``port``, asked directly (never through a proxy)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{COUNT_PATH}", timeout=10) as r:
        doc: dict[str, dict[str, int]] = json.loads(r.read())
    return doc
