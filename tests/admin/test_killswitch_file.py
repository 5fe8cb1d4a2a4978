"""Fleet-wide kill switches in the policy file (``killswitches:``): validation that names the
line, expiry, the two sources side by side, and what a reload does to them."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar.admin.killswitch import KillSwitch
from sidecar.config.errors import ConfigError
from sidecar.config.killswitches import parse_until
from sidecar.config.model import FileKillSwitch
from sidecar.config.parse import parse_text
from sidecar.testing import FakeClock
from tests.conftest import reply, routes_yaml

BASE = """version: 1
routes:
  - name: orders
    upstream: "http://127.0.0.1:8080"
  - name: users
    upstream: "http://127.0.0.1:8080"
"""
FUTURE = "2099-01-01T00:00:00Z"


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_text(text, "p.yaml")
    return info.value.lines()


def test_entries_parse_with_their_lines():
    cfg = parse_text(
        BASE
        + f"""killswitches:
  - scope: route:orders
    reason: "INC-1 retries amplify"
    until: {FUTURE}
  - {{scope: global, reason: "all", until: "2099-01-01T02:00:00+02:00"}}
""",
        "p.yaml",
    )
    a, b = cfg.killswitches
    assert (a.scope, a.reason, a.line, a.index) == ("route:orders", "INC-1 retries amplify", 8, 0)
    assert a.until == 4070908800.0
    assert (b.scope, b.line, b.until) == ("global", 11, 4070908800.0)  # the offset is applied


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ('{scope: route:nope, reason: x, until: "2099-01-01T00:00:00Z"}', "killswitches[0].scope"),
        ('{scope: everything, reason: x, until: "2099-01-01T00:00:00Z"}', "killswitches[0].scope"),
        ('{scope: global, reason: "", until: "2099-01-01T00:00:00Z"}', "killswitches[0].reason"),
        ("{scope: global, reason: x, until: 2099-01-01 00:00:00}", "needs a UTC offset"),
        ("{scope: global, reason: x, until: 2099-01-01}", "needs a time of day"),
        ("{scope: global, reason: x, until: tomorrow}", "RFC 3339"),
        ('{scope: global, reason: x, until: "2099-13-01T00:00:00Z"}', "not a valid time"),
        # Instants that are no UTC time this process can show (year 10000, year 0): they
        # passed validate, then crashed every apply, the admin API and every restart.
        ("{scope: global, reason: x, until: 9999-12-31T23:59:59-05:00}", "outside the times"),
        ('{scope: global, reason: x, until: "9999-12-31T23:59:59-05:00"}', "outside the times"),
        ('{scope: global, reason: x, until: "0001-01-01T00:00:00+23:59"}', "outside the times"),
        ("{scope: global, reason: x, until: 0001-01-01T00:00:00+23:59}", "outside the times"),
        # The float of the last microsecond rounds up into the year 10000.
        ('{scope: global, reason: x, until: "9999-12-31T23:59:59.999999Z"}', "outside the times"),
        ("{scope: global, reason: x}", "killswitches[0].until: required"),
        ('{scope: global, reason: x, until: "2099-01-01T00:00:00Z", ttl: 5m}', "unknown key"),
        ("just-a-string", "expected a mapping"),
    ],
)
def test_bad_entries_name_line_and_key(entry, expected):
    lines = errors_of(BASE + "killswitches:\n  - " + entry + "\n")
    assert any(line.startswith("p.yaml:8: ") and expected in line for line in lines), lines


def test_duplicate_scope_and_wrong_type():
    lines = errors_of(
        BASE
        + f"""killswitches:
  - {{scope: global, reason: a, until: "{FUTURE}"}}
  - {{scope: global, reason: b, until: "{FUTURE}"}}
"""
    )
    assert lines == ["p.yaml:9: killswitches[1].scope: duplicate scope (also killswitches[0])"]
    assert errors_of(BASE + "killswitches: global\n") == [
        "p.yaml:7: killswitches: expected a list of {scope, reason, until} entries"
    ]


def test_until_accepts_rfc3339_forms():
    assert parse_until("2099-01-01T00:00:00Z") == parse_until("2099-01-01t01:00:00.000+01:00")
    # The ends of the range are instants like any other (the first one has long passed).
    assert parse_until("9999-12-31T23:59:59Z") == 253402300799.0
    assert parse_until("0001-01-01T00:00:00Z") == -62135596800.0
    assert parse_until("2099-01-01 00:00:00z") == 4070908800.0
    with pytest.raises(ValueError):
        parse_until(1700000000)


def test_load_file_replaces_file_switches_and_keeps_admin_ones():
    k = KillSwitch(lambda: 1000.0)
    k.set("route:orders", 3600.0, "manual", "10.0.0.1", now=0.0, wall=1000.0)
    expired = k.load_file(
        [
            FileKillSwitch("global", "fleet", 1100.0, 7, 0),
            FileKillSwitch("route:users", "old", 900.0, 10, 1),
        ],
        "p.yaml",
        wall=1000.0,
    )
    assert [e.scope for e in expired] == ["route:users"]
    assert [(s.scope, s.source, s.set_by) for s in k.active(1.0)] == [
        ("global", "file", "p.yaml:7"),
        ("route:orders", "admin", "10.0.0.1"),
    ]
    # A reload that no longer has the entry lifts it; the admin switch is untouched.
    k.load_file([], "p.yaml", wall=1005.0)
    assert [s.source for s in k.active(6.0)] == ["admin"]
    assert not k.lift("global")


def test_an_unchanged_entry_keeps_when_it_was_set():
    k = KillSwitch(lambda: 1000.0)
    entry = FileKillSwitch("global", "fleet", 5000.0, 7, 0)
    k.load_file([entry], "p.yaml", wall=1000.0)
    k.load_file([entry], "p.yaml", wall=1010.0)
    assert k.active(11.0)[0].set_at == 1000.0
    k.load_file([FileKillSwitch("global", "new reason", 5000.0, 7, 0)], "p.yaml", 1020.0)
    assert k.active(21.0)[0].set_at == 1020.0


def test_a_file_switch_ends_at_its_until_on_the_wall_clock_however_it_is_corrected():
    """Outside finding: the until was turned into a monotonic deadline once, at load, so a
    host clock correction made the switch lift 22 s early. It is an instant: compared with
    the (injected) wall clock each time it is asked about; an admin TTL, a duration, stays
    on the monotonic clock."""
    clock = FakeClock(monotonic=0.0, wall=1000.0)
    k = KillSwitch(clock.wall)
    k.load_file([FileKillSwitch("global", "fleet", 1100.0, 7, 0)], "p.yaml", clock.wall())
    k.set("route:orders", 100.0, "manual", "me", clock.monotonic(), clock.wall())
    clock.step_wall(-30.0)  # the host clock ran 30 s fast; corrected back
    clock.advance(100.0)  # wall 1070: until (1100) not reached, 100 s since the load
    assert k.covers("users", clock.monotonic())  # the file switch holds on
    assert [s.source for s in k.active(clock.monotonic())] == ["file"]  # the TTL is spent
    clock.advance(29.0)
    assert k.covers("users", clock.monotonic())
    clock.advance(1.0)  # wall 1100
    assert not k.covers("users", clock.monotonic())
    # Stepped forward past it, the instant has come whatever the monotonic clock says.
    k.load_file([FileKillSwitch("global", "fleet", 2000.0, 7, 0)], "p.yaml", clock.wall())
    assert k.file_switch("global", clock.monotonic()) is not None
    clock.step_wall(900.0)
    assert k.file_switch("global", clock.monotonic()) is None and k.active(clock.monotonic()) == []


def test_both_sources_for_one_scope():
    k = KillSwitch(lambda: 1000.0)
    k.load_file([FileKillSwitch("route:orders", "fleet", 2000.0, 7, 0)], "p", 1000.0)
    k.set("route:orders", 60.0, "manual", "me", now=0.0, wall=1000.0)
    assert [s.source for s in k.active(1.0)] == ["admin", "file"]
    assert k.lift("route:orders")
    assert k.covers("orders", 2.0)  # the file switch still holds
    assert k.file_switch("route:orders", 2.0) is not None


def test_validate_warns_about_expired_entries_and_passes(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        BASE
        + f"""killswitches:
  - {{scope: global, reason: old, until: "2001-01-01T00:00:00Z"}}
  - {{scope: route:users, reason: new, until: "{FUTURE}"}}
"""
    )
    res = subprocess.run(
        [sys.executable, "-m", "sidecar", "validate", str(path)], capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout == "OK: 2 routes\n"
    assert res.stderr == (
        f"{path}:8: killswitches[0].until: 2001-01-01T00:00:00Z has passed; "
        "the global switch is ignored\n"
    )


def policy(up_url: str, switches: str = "") -> str:
    text = routes_yaml(up_url, "    breaker: {min_sequences: 100000}")
    return text + (f"killswitches:\n{switches}" if switches else "")


async def test_a_reload_sets_and_lifts_file_switches(
    upstream_factory, sidecar_factory, client, tmp_path, caplog
):
    caplog.set_level(logging.WARNING)
    up = await upstream_factory(reply(503))
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(policy(up.url))
    sc = await sidecar_factory(cfg.read_text(), config_path=str(cfg))
    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-attempts"] == "3"

    cfg.write_text(
        policy(
            up.url,
            f'  - {{scope: route:main, reason: "INC-5 fleet-wide", until: "{FUTURE}"}}\n'
            '  - {scope: global, reason: "forgotten", until: "2001-01-01T00:00:00Z"}\n',
        )
    )
    assert (await sc.sidecar.reload("test")).ok  # type: ignore[union-attr]
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-attempts"] == "1"
        assert resp.headers["x-retry-fate"] == "kill-switch"
    async with client.get(admin + "/killswitch") as resp:
        [sw] = (await resp.json())["switches"]
    assert sw["source"] == "file" and sw["scope"] == "route:main"
    assert sw["expires_at"] == "2099-01-01T00:00:00.000Z" and sw["set_by"].endswith(":15")
    assert any("killswitches[1].until" in r.getMessage() for r in caplog.records)
    async with client.get(admin + "/metrics") as resp:
        assert 'retry_sidecar_kill_switch_active{scope="route:main"} 1' in await resp.text()

    # Not liftable through the API: the file would put it back.
    async with client.delete(admin + "/killswitch", params={"scope": "route:main"}) as resp:
        assert resp.status == 409
        assert "policy file" in (await resp.json())["error"]
    # An admin switch beside it, lifted: the file one remains and is reported.
    async with client.put(
        admin + "/killswitch", json={"scope": "route:main", "ttl": "1m", "reason": "also"}
    ) as resp:
        assert resp.status == 200 and (await resp.json())["source"] == "admin"
    async with client.delete(admin + "/killswitch", params={"scope": "route:main"}) as resp:
        body = await resp.json()
    assert body["lifted"] == "route:main" and [s["source"] for s in body["remaining"]] == ["file"]

    cfg.write_text(policy(up.url))  # the entry removed from the file: lifted everywhere
    assert (await sc.sidecar.reload("test")).ok  # type: ignore[union-attr]
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-attempts"] == "3"
    async with client.get(admin + "/killswitch") as resp:
        assert (await resp.json())["switches"] == []


async def test_an_invalid_entry_keeps_the_last_good_switches(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(policy(up.url, f'  - {{scope: global, reason: "on", until: "{FUTURE}"}}\n'))
    sc = await sidecar_factory(cfg.read_text(), config_path=str(cfg))
    assert [s.scope for s in sc.sidecar.kill.active(time.monotonic())] == ["global"]
    cfg.write_text(policy(up.url, '  - {scope: global, reason: "on", until: "next week"}\n'))
    result = await sc.sidecar.reload("test")  # type: ignore[union-attr]
    assert result is not None and not result.ok
    line = (
        cfg.read_text().splitlines().index('  - {scope: global, reason: "on", until: "next week"}')
    )
    [err] = result.errors
    assert err.startswith(f"{cfg}:{line + 1}: killswitches[0].until: ") and "RFC 3339" in err
    assert [s.scope for s in sc.sidecar.kill.active(time.monotonic())] == ["global"]


def test_the_example_config_documents_the_section():
    text = (Path(__file__).resolve().parents[2] / "config" / "sidecar.yaml").read_text()
    assert "killswitches:" in text
    parse_text(text)
