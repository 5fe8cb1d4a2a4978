"""A small WSGI app for gunicorn's default single sync worker, as many real apps run: it
handles one request at a time and counts what it handled, per path, so a test can tell how
many requests a proxy really made it run."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

_handled: Counter[str] = Counter()
_lock = threading.Lock()

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "/")
    if path == "/count":
        with _lock:
            body = json.dumps(dict(_handled)).encode()
    else:
        with _lock:
            _handled[path] += 1
        query = parse_qs(environ.get("QUERY_STRING", ""))
        time.sleep(int(query.get("ms", ["0"])[0]) / 1000)
        body = b"done"
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


def start_single_worker_app(port: int) -> subprocess.Popen[bytes]:
    """This app under gunicorn's defaults: one sync worker, one request at a time."""
    from tests.difftools import run_gunicorn  # not in gunicorn's worker, which imports this

    return run_gunicorn(port, "tests.realapp:app", ready="/count")
