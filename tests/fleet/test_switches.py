"""The fleet kill switches' pure merge (sidecar/fleet/switches.py) and their place beside the
admin and file switches (sidecar/admin/killswitch.py), with an injected wall clock."""

from __future__ import annotations

from sidecar.admin.killswitch import KillSwitch
from sidecar.config.fleet import Fleet, FleetRedis
from sidecar.core import Clock
from sidecar.fleet.links import FleetLinks
from sidecar.fleet.switches import FleetSwitch, FleetSwitches, in_force, merge, parse
from sidecar.testing import FakeClock

GLOBAL = FleetSwitch("global", "db down", "10.0.0.9", "pod-a", 1000.0, 1900.0)
ROUTE = FleetSwitch("route:orders", "slow", "10.0.0.9", "pod-b", 1000.0, 1100.0)


def test_a_switch_survives_its_encoding() -> None:
    assert parse(GLOBAL.encode()) == GLOBAL


def test_merge_keeps_the_switches_in_force_and_names_the_rest_to_delete() -> None:
    read = {
        b"global": GLOBAL.encode(),
        b"route:orders": ROUTE.encode(),
        b"route:junk": b"not json",
        b"route:other": GLOBAL.encode(),  # a field whose value names another scope
    }
    live, stale = merge(read, 1050.0)
    assert live == {"global": GLOBAL, "route:orders": ROUTE}
    assert sorted(stale) == [b"route:junk", b"route:other"]
    live, stale = merge(read, 1100.0)  # the route switch ends at its expires_at
    assert live == {"global": GLOBAL}
    assert b"route:orders" in stale


def test_what_was_known_ends_at_its_expiry_without_a_read() -> None:
    known = {"global": GLOBAL, "route:orders": ROUTE}
    assert in_force(known, 1099.9) == [GLOBAL, ROUTE]
    assert in_force(known, 1100.0) == [GLOBAL]
    assert in_force(known, 1900.0) == []


def fleet_switches(clock: FakeClock) -> FleetSwitches:
    settings = Fleet(FleetRedis(url="redis://127.0.0.1:9/0"), killswitch=True)
    made = FleetSwitches.of(settings, clock, FleetLinks())
    assert made is not None
    return made


def test_fleet_switches_are_a_third_source_ending_on_the_wall_clock() -> None:
    clock = FakeClock(wall=1050.0)
    fleet = fleet_switches(clock)
    kill = KillSwitch(clock.wall, fleet)
    nudged: list[int] = []
    kill.on_set(lambda: nudged.append(1))
    fleet._replace({"route:orders": ROUTE})  # what a read of the shared hash brings
    assert nudged == [1]
    assert kill.covers("orders", 0.0) and not kill.covers("other", 0.0)
    [sw] = kill.active(0.0)
    assert sw.as_json() == {
        "scope": "route:orders",
        "reason": "slow",
        "set_by": "10.0.0.9",
        "set_at": 1000.0,
        "expires_at": 1100.0,
        "source": "fleet",
        "set_on": "pod-b",
    }
    clock.step_wall(50.0)
    assert not kill.covers("orders", 0.0) and kill.active(0.0) == []


def test_without_fleet_switches_there_is_no_fleet_source() -> None:
    links = FleetLinks()
    assert FleetSwitches.of(Fleet(), Clock(), links) is None
    assert links.states() == []  # no link made, none shown
    assert KillSwitch().fleet is None
