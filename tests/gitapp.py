"""git over smart HTTP: dulwich's WSGI app (the bare repository ``$GITAPP_ROOT/repo.git``)
under gunicorn's threaded worker, counting what it handled; and the workload, a ``git push``
of a repository with a 20 MiB blob, then a ``git clone`` of it, with the real ``git`` binary
if there is one, else dulwich's own client."""

from __future__ import annotations

import hashlib
import io
import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from tests.difftools import run_gunicorn
from tests.threeways import Tally
from tests.wsgicount import COUNT_PATH, Counting, StartResponse, WsgiApp, read_count

BLOB_BYTES = 20 * 1024 * 1024
REPO = "repo.git"


def request_key(environ: dict[str, Any]) -> str:
    """``GET info/refs?service=git-upload-pack``, ``POST git-receive-pack``, ..."""
    path = str(environ.get("PATH_INFO", ""))
    tail = path.rsplit("/", 2)[-2:] if path.endswith("info/refs") else path.rsplit("/", 1)[-1:]
    service = parse_qs(str(environ.get("QUERY_STRING", ""))).get("service", [""])[0]
    return f"{environ.get('REQUEST_METHOD')} {'/'.join(tail)}" + (
        f"?service={service}" if service else ""
    )


def server_dechunked(app: WsgiApp) -> WsgiApp:
    """gunicorn hands the app a chunked body already decoded (``wsgi.input_terminated``), but
    dulwich decodes again whenever ``Transfer-Encoding: chunked`` is in the environ, and a
    push larger than git's ``http.postBuffer`` (1 MiB) is sent chunked: the header goes."""

    def call(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("wsgi.input_terminated"):
            environ.pop("HTTP_TRANSFER_ENCODING", None)
        return app(environ, start_response)

    return call


def make_app() -> WsgiApp:
    """gunicorn's app factory: ``tests.gitapp:make_app()``."""
    from dulwich.repo import Repo
    from dulwich.server import BackendRepo, DictBackend
    from dulwich.web import make_wsgi_chain

    repos: dict[str, BackendRepo] = {f"/{REPO}": Repo(str(Path(os.environ["GITAPP_ROOT"]) / REPO))}
    backend = DictBackend(repos)
    return Counting(server_dechunked(make_wsgi_chain(backend)), request_key)


def start(port: int, root: Path) -> subprocess.Popen[bytes]:
    """A fresh empty bare repository ``repo.git`` under ``root``, served on ``port``."""
    from dulwich.repo import Repo

    (root / REPO).mkdir(parents=True)
    Repo.init_bare(str(root / REPO))
    threaded = ("--worker-class", "gthread", "--threads", "8")
    return run_gunicorn(
        port,
        "tests.gitapp:make_app()",
        *threaded,
        ready=COUNT_PATH,
        what="dulwich under gunicorn",
        env={**os.environ, "GITAPP_ROOT": str(root)},
    )


def blob() -> bytes:
    """20 MiB that do not compress (a release tarball, say), the same on every run."""
    return random.Random(20).randbytes(BLOB_BYTES)


def git_binary() -> str | None:
    return shutil.which("git")


def _git(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess[bytes]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.test",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.test",
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, timeout=120, check=False
    )


def make_source(work: Path) -> str:
    """A repository with one commit: a README and the 20 MiB blob; returns its commit id."""
    src = work / "src"
    src.mkdir(parents=True)
    (src / "README").write_text("a repository with a large file\n")
    (src / "big.bin").write_bytes(blob())
    if git_binary():
        for args in (
            ("init", "-q", "-b", "main"),
            ("add", "README", "big.bin"),
            ("commit", "-q", "-m", "large file"),
        ):
            r = _git(*args, cwd=src, home=work)
            assert r.returncode == 0, r.stderr.decode()
        return _git("rev-parse", "HEAD", cwd=src, home=work).stdout.decode().strip()
    from dulwich import porcelain

    repo = porcelain.init(str(src))
    porcelain.add(repo, [str(src / "README"), str(src / "big.bin")])
    commit = porcelain.commit(
        repo, message=b"large file", author=b"t <t@example.test>", committer=b"t <t@example.test>"
    )
    return commit.decode() if isinstance(commit, bytes) else str(commit)


def push_and_clone(base: str, work: Path, commit: str) -> dict[str, object]:
    """Push the source repository to ``base``/repo.git, clone it back; what the client saw."""
    url = f"{base}/{REPO}"
    src, dst = work / "src", work / f"clone-{time.monotonic_ns()}"
    outcome: dict[str, object] = {}
    if git_binary():
        push = _git("push", "-q", url, "main:refs/heads/main", cwd=src, home=work)
        outcome["push"] = push.returncode == 0 or push.stderr.decode()[-500:]
        clone = _git("clone", "-q", "-b", "main", url, str(dst), cwd=work, home=work)
        outcome["clone"] = clone.returncode == 0 or clone.stderr.decode()[-500:]
        if clone.returncode == 0:
            head = _git("rev-parse", "HEAD", cwd=dst, home=work).stdout.decode().strip()
            outcome["head_is_pushed_commit"] = head == commit
    else:
        from dulwich import porcelain

        try:
            porcelain.push(
                str(src), url, b"refs/heads/master:refs/heads/main", errstream=io.BytesIO()
            )
            outcome["push"] = True
        except Exception as exc:
            outcome["push"] = repr(exc)[-500:]
        try:
            repo = porcelain.clone(url, str(dst), branch=b"main", errstream=io.BytesIO())
            outcome["clone"] = True
            outcome["head_is_pushed_commit"] = repo.head().decode() == commit
        except Exception as exc:
            outcome["clone"] = repr(exc)[-500:]
    big = dst / "big.bin"
    outcome["blob_intact"] = big.exists() and (
        hashlib.sha256(big.read_bytes()).digest() == hashlib.sha256(blob()).digest()
    )
    return outcome


def run(base: str, app_port: int, work: Path, commit: str) -> Tally:
    """The workload against a fresh server: push, clone, and the server's own counts."""
    t0 = time.monotonic()
    outcome = push_and_clone(base, work, commit)
    seconds = time.monotonic() - t0
    count = read_count(app_port)
    outcome["app_statuses"] = count["statuses"]
    ok = sum(1 for k in ("push", "clone") if outcome.get(k) is True)
    return Tally(
        outcome=outcome,
        answered=ok,
        refused=2 - ok,
        handled=count["handled"],
        seconds=seconds,
    )
