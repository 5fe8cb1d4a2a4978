"""Fixtures of the gRPC tests (tests/proxy/test_grpc*.py): one sidecar and one grpcio peer per
test module (tests/grpcrig.py), the peer's plan and record cleared before each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import grpcrig
from tests.grpcrig import Rig


@pytest.fixture(scope="module")
def module_rig(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rig]:
    with grpcrig.rig(tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])) as r:
        yield r


@pytest.fixture
def rig(module_rig: Rig) -> Rig:
    module_rig.peer.reset()
    return module_rig
