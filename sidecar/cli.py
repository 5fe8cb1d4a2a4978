"""The ``retry-sidecar`` command line: run, validate, explain, demo, and the verbs that talk to a
running sidecar's admin API (healthcheck, status, killswitch, dlq, idempotency)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from sidecar import __version__, build
from sidecar.config.errors import ConfigError
from sidecar.config.model import Config
from sidecar.config.parse import parse_file

if TYPE_CHECKING:
    from sidecar.admin.client import AdminTarget

DEFAULT_CONFIG = "config/sidecar.yaml"
log = logging.getLogger("sidecar")


def default_config_path() -> str:
    return os.environ.get("RETRY_SIDECAR_CONFIG") or DEFAULT_CONFIG


def _printable(text: str) -> str:
    """A line for the terminal with its control characters escaped (``fmt.printable``): a
    config's values and a server's answers are printed, never obeyed."""
    from sidecar.admin.fmt import printable

    return printable(text)


def _load_or_exit(path: str) -> Config:
    try:
        return parse_file(path)
    except ConfigError as exc:
        for line in exc.lines():
            print(_printable(line), file=sys.stderr)
        raise SystemExit(1) from None


def _parse_or_print(path: str) -> Config | None:
    """For validate and explain: errors go to stdout, one line each."""
    try:
        return parse_file(path)
    except ConfigError as exc:
        for line in exc.lines():
            print(_printable(line))
        return None


def cmd_validate(args: argparse.Namespace) -> int:
    config = _parse_or_print(args.path or args.config or default_config_path())
    if config is None:
        return 1
    import time

    from sidecar.config.killswitches import expired, expired_warning

    for e in expired(config.killswitches, time.time()):  # valid, but ignored when loaded
        print(_printable(expired_warning(config.source, e)), file=sys.stderr)
    for w in config.warnings:  # valid, but surprising: the line, the key and the fix
        print(_printable("warning: " + w.render(config.source)), file=sys.stderr)
    n = len(config.routes)
    print(f"OK: {n} route{'s' if n != 1 else ''}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from sidecar.explain import explain

    config = _parse_or_print(args.path or args.config or default_config_path())
    if config is None:
        return 1
    print("\n".join(_printable(line) for line in explain(config).split("\n")))
    return 0


def _admin_target(args: argparse.Namespace) -> AdminTarget:
    from sidecar.admin.client import target_from

    config = None
    path = args.config or default_config_path()
    if not args.admin or os.path.exists(path):
        config = _load_or_exit(path)
    return target_from(config, args.admin)


def cmd_healthcheck(args: argparse.Namespace) -> int:
    from sidecar.admin.client import call

    target = _admin_target(args)
    try:
        status, _ = call(target, "GET", "/healthz", timeout=args.timeout)
    except OSError as exc:
        print(_printable(f"unhealthy: {target.base}/healthz: {exc}"), file=sys.stderr)
        return 1
    if status != 200:
        print(_printable(f"unhealthy: {target.base}/healthz answered {status}"), file=sys.stderr)
        return 1
    print("healthy")
    return 0


def cmd_dlq(args: argparse.Namespace) -> int:
    """dlq list|show|replay|purge against a running sidecar's admin API."""
    from urllib.parse import urlencode

    from sidecar.admin.fmt import printable_json
    from sidecar.admin.verbs import call_admin as call
    from sidecar.admin.verbs import fail, replay_verdict

    target = _admin_target(args)
    q: dict[str, str] = {}
    if args.dlq_verb == "list":
        q = {
            k: v
            for k, v in (
                ("route", args.route),
                ("status", args.status),
                ("limit", args.limit),
                ("order", args.order),
                ("cursor", args.cursor),
            )
            if v
        }
        path = "/dlq" + ("?" + urlencode(q) if q else "")
        status, body = call(target, "GET", path)
    elif args.dlq_verb == "show":
        status, body = call(target, "GET", f"/dlq/{args.id}")
    elif args.dlq_verb == "replay":
        if args.id:
            status, body = call(target, "POST", f"/dlq/{args.id}/replay", timeout=120)
        else:
            batch: dict[str, object] = {
                "status": args.status or "pending",
                "limit": int(args.limit or 100),
                "dry_run": args.dry_run,
            }
            if args.route:
                batch["route"] = args.route
            status, body = call(target, "POST", "/dlq/replay", batch, timeout=600)
    else:
        status, body = call(target, "DELETE", f"/dlq/{args.id}")
    if not 200 <= status < 300:
        return fail(status, body)  # on stderr, as every verb's errors: stdout stays data
    if args.dlq_verb == "list" and args.output == "text":
        if not body["records"]:
            print(_printable(f"no DLQ records{_filters(q)}"))
        for r in body["records"]:
            r = {k: _printable(str(v)) for k, v in r.items()}
            print(
                f"{r['id']}  {r['status']:<9} {r['route']:<16} {r['method']:<6} "
                f"{r['fate']:<18} replays={r['replays']}  {r['created_at']}  {r['target']}"
            )
        if body.get("next"):
            print(_printable(f"(more: the same command with --cursor {body['next']})"))
    else:
        print(printable_json(body))
    if args.dlq_verb == "replay" and not args.dry_run:
        return replay_verdict(body)
    return 0


def _filters(q: dict[str, str]) -> str:
    """The filters of an empty ``dlq list``, so that "none" says what was asked."""
    shown = ", ".join(f"{k} {v}" for k, v in q.items() if k in ("route", "status"))
    return f" ({shown})" if shown else ""


def cmd_idempotency(args: argparse.Namespace) -> int:
    """idempotency show|forget KEY against a running sidecar's admin API."""
    from sidecar.admin.verbs import cmd_idempotency as idempotency

    scope = args.scope
    if args.scope_value is not None:
        scope = _scope_of_value(args.scope_value, args.scope_header)
    return idempotency(_admin_target(args), args.idem_verb, args.key, scope, route=args.route)


def _scope_of_value(value: str, header: str) -> str:
    """The scope digest a route with ``scope_header: <header>`` stores a key under when the
    client sends ``<header>: <value>`` (``-``: one line read from stdin, kept out of the shell's
    history), computed here as the route does (``fingerprint.scope_digest``); its label is
    told on stderr. Only the digest goes to the admin API, never the value."""
    from sidecar.idempotency.fingerprint import scope_digest

    if value == "-":
        value = sys.stdin.readline().rstrip("\r\n")
    raw = value.encode("utf-8", "surrogateescape")
    digest = scope_digest([(header.encode("latin-1"), raw)], header)
    print(f"scope label of that {header} value: {digest[:12]}", file=sys.stderr)
    return digest


def cmd_status(args: argparse.Namespace) -> int:
    from sidecar.admin.verbs import cmd_status as status

    return status(_admin_target(args), args.window, args.output == "json")


def cmd_killswitch(args: argparse.Namespace) -> int:
    from sidecar.admin.verbs import cmd_killswitch as killswitch

    return killswitch(
        _admin_target(args),
        args.ks_verb,
        getattr(args, "scope", None),
        getattr(args, "ttl", None),
        getattr(args, "reason", None),
        getattr(args, "output", "text") == "json",
    )


def cmd_run(args: argparse.Namespace) -> int:
    from sidecar.app import Sidecar
    from sidecar.heapfreeze import freeze_startup_heap
    from sidecar.proxy.runner import c_parser_in_use
    from sidecar.telemetry import logs

    logs.setup(args.log_level)
    config = _load_or_exit(args.config or default_config_path())  # nothing listens on error
    for w in config.warnings:
        log.warning("config: %s", w.render(config.source))
    if not c_parser_in_use() and not args.allow_python_parser:
        print(
            "error: aiohttp's C HTTP parser is not in use (AIOHTTP_NO_EXTENSIONS set, or no "
            "compiled wheel); its pure-Python fallback has had request-smuggling advisories. "
            "Install a compiled aiohttp or pass --allow-python-parser.",
            file=sys.stderr,
        )
        return 2

    path = args.config or default_config_path()

    async def main() -> int:
        from sidecar.admin.auth import AdminStartError
        from sidecar.telemetry.tracing import Tracing

        sidecar = Sidecar(config, config_path=path, tracing=Tracing.from_env(config.name))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(
            signal.SIGHUP, lambda: sidecar.spawn("sighup-reload", sidecar.reload("SIGHUP"))
        )
        try:
            await sidecar.start()
        except AdminStartError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"error: cannot listen: {exc}", file=sys.stderr)
            return 1
        freeze_startup_heap()
        await stop.wait()
        log.info("shutting down")
        await sidecar.stop()
        return 0

    return _run_loop(main())


def _run_loop(coro: Coroutine[Any, Any, int]) -> int:
    import uvloop

    result: int = uvloop.run(coro)
    return result


def cmd_demo(args: argparse.Namespace) -> int:
    from sidecar.demo import run_demo

    return _run_loop(run_demo(requests=args.requests, seed=args.seed))


def _output_options(verb: argparse.ArgumentParser) -> None:
    """``--json``, and ``-o json|text`` / ``--output`` beside it (the kubectl, istioctl and
    linkerd habit): the same choice, the last one written wins."""
    verb.add_argument(
        "--json", dest="output", action="store_const", const="json", help="print the raw JSON"
    )
    verb.add_argument(
        "-o", "--output", dest="output", choices=["text", "json"], help="text (default) or json"
    )
    verb.set_defaults(output="text")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="retry-sidecar", description="An HTTP reverse proxy that does retries right."
    )
    p.add_argument(
        "--version",
        action="version",
        version=f"retry-sidecar {__version__} ({build()} build)",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        help=f"config file (default: $RETRY_SIDECAR_CONFIG, else {DEFAULT_CONFIG})",
    )
    sub = p.add_subparsers(dest="verb", required=True)

    run = sub.add_parser("run", parents=[common], help="run the proxy")
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    run.add_argument(
        "--allow-python-parser",
        action="store_true",
        help="run even if aiohttp's C parser is missing (not recommended)",
    )
    run.set_defaults(func=cmd_run)

    val = sub.add_parser("validate", parents=[common], help="check a config file")
    val.add_argument("path", nargs="?", help="the file to check")
    val.set_defaults(func=cmd_validate)

    admin_common = argparse.ArgumentParser(add_help=False)
    admin_common.add_argument(
        "--admin", help="admin URL, e.g. http://127.0.0.1:15000 (default: from the config)"
    )
    hc = sub.add_parser(
        "healthcheck", parents=[common, admin_common], help="exit 0 if /healthz answers 200"
    )
    hc.add_argument("--timeout", type=float, default=3.0)
    hc.set_defaults(func=cmd_healthcheck)

    # --config/--admin go after the verb (dlq list --config ...): argparse would let a
    # sub-parser's defaults overwrite values given before it.
    dlq = sub.add_parser("dlq", help="inspect and replay the dead-letter queue")
    dsub = dlq.add_subparsers(dest="dlq_verb", required=True)
    dl = dsub.add_parser("list", parents=[common, admin_common], help="list records")
    dl.add_argument("--route")
    dl.add_argument("--status", choices=["pending", "delivered", "parked"])
    dl.add_argument("--limit")
    dl.add_argument("--order", choices=["newest", "oldest"])
    dl.add_argument("--cursor", help="the next page: the value a previous page printed")
    _output_options(dl)
    ds = dsub.add_parser("show", parents=[common, admin_common], help="one record with its body")
    ds.add_argument("id")
    dr = dsub.add_parser(
        "replay", parents=[common, admin_common], help="replay one record, or a filtered batch"
    )
    dr.add_argument("id", nargs="?", help="one record; without it, a batch by filters")
    dr.add_argument("--route")
    dr.add_argument("--status", choices=["pending", "parked"])
    dr.add_argument("--limit")
    dr.add_argument("--dry-run", action="store_true")
    dp = dsub.add_parser("purge", parents=[common, admin_common], help="delete one record")
    dp.add_argument("id")
    dlq.set_defaults(func=cmd_dlq)

    idem = sub.add_parser("idempotency", help="show or forget a kept Idempotency-Key")
    isub = idem.add_subparsers(dest="idem_verb", required=True)
    for verb, what in (("show", "what is kept under a key"), ("forget", "forget a key")):
        iv = isub.add_parser(verb, parents=[common, admin_common], help=what)
        iv.add_argument("key")
        which = iv.add_mutually_exclusive_group()
        which.add_argument(
            "--scope",
            help="one scope of the key (routes with scope_header): the label show lists, or -",
        )
        which.add_argument(
            "--scope-value",
            metavar="VALUE",
            help="the scope of a client that sends this value in the scope header (e.g. "
            "'Bearer tok'; - reads it from stdin): its digest is computed here, only the "
            "digest is sent",
        )
        iv.add_argument(
            "--scope-header",
            default="Authorization",
            metavar="NAME",
            help="the route's scope_header, for --scope-value (default: Authorization)",
        )
        iv.add_argument(
            "--route",
            help="the key on one route (keys live per route), or - for names stored without one",
        )
    idem.set_defaults(func=cmd_idempotency)

    st = sub.add_parser(
        "status",
        parents=[common, admin_common],
        help="per route: traffic, fates, breaker, budget, kill switches, DLQ (a table)",
    )
    st.add_argument("--window", choices=["10s", "1m", "5m"], default="1m")
    _output_options(st)
    st.set_defaults(func=cmd_status)

    ks = sub.add_parser("killswitch", help="list, set or lift kill switches (retries off)")
    kssub = ks.add_subparsers(dest="ks_verb", required=True)
    ksl = kssub.add_parser("list", parents=[common, admin_common], help="active switches")
    _output_options(ksl)
    kss = kssub.add_parser(
        "set", parents=[common, admin_common], help="retries off for a scope, for a while"
    )
    kss.add_argument("scope", help='"global" or "route:<name>"')
    kss.add_argument("--ttl", required=True, help="how long, e.g. 15m (at most 24h)")
    kss.add_argument("--reason", required=True, help="why; shown on the page and logged")
    ksf = kssub.add_parser("lift", parents=[common, admin_common], help="lift a switch early")
    ksf.add_argument("scope")
    ks.set_defaults(func=cmd_killswitch)

    exp = sub.add_parser(
        "explain", parents=[common], help="worst cases per route: attempts, time, load"
    )
    exp.add_argument("path", nargs="?", help="the file to explain")
    exp.set_defaults(func=cmd_explain)

    demo = sub.add_parser(
        "demo", parents=[common], help="a flaky upstream, a sidecar, a burst of traffic"
    )
    demo.add_argument(
        "--requests",
        type=int,
        default=100,
        help="requests per endpoint, direct and via the sidecar",
    )
    demo.add_argument("--seed", type=int, default=None, help="seed for the flaky upstream")
    demo.set_defaults(func=cmd_demo)
    return p


# What a verb exits with when whoever reads its output stopped reading (``status | head -1``):
# 128 + SIGPIPE, what the shell reports for git, kubectl or cat stopped the same way, so a
# ``set -o pipefail`` script sees the same thing as for them.
EXIT_PIPE_CLOSED = 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a reader gone after the last write shows here, not at exit
    except BrokenPipeError:
        _stdout_gone()
        return EXIT_PIPE_CLOSED
    return code


def _stdout_gone() -> None:
    """The reader of stdout left: stop quietly, as Unix tools do (no traceback). What is
    still buffered is dropped: stdout is pointed at /dev/null so that the interpreter's own
    flush at exit has nowhere to fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
