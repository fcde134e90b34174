"""tests/ports.py: the runs scripts/test.sh puts side by side never take the same loopback port."""
from __future__ import annotations

import pytest

import ports


@pytest.fixture(autouse=True)
def _not_a_worker(monkeypatch):
    """As in one pytest process: these tests may themselves run on a pytest-xdist worker."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)


@pytest.mark.parametrize("spec, lane", [("0/2", (0, 2)), ("1/2", (1, 2)), (" 2/3 ", (2, 3)), ("", (0, 1))])
def test_each_lane_takes_only_its_own_ports(monkeypatch, spec, lane):
    monkeypatch.setenv("PRECISION_LORA_PORT_LANE", spec)
    assert ports.lane() == lane
    i, n = lane
    slices = [ports.lane_range(k, n) for k in range(n)]
    assert all(ports.free_port() in slices[i] for _ in range(50))
    assert not set(slices[i]) & {p for k, s in enumerate(slices) if k != i for p in s}


@pytest.mark.parametrize("spec, message", [("2/2", "the lane must be 0..1"), ("x", "expected '<lane>/<lanes>'"),
                                           ("1/0", "the lane must be 0..-1")])
def test_a_malformed_lane_is_refused_by_name(monkeypatch, spec, message):
    monkeypatch.setenv("PRECISION_LORA_PORT_LANE", spec)
    with pytest.raises(ValueError, match="PRECISION_LORA_PORT_LANE") as e:
        ports.free_port()
    assert message in str(e.value)


@pytest.mark.parametrize("spec, worker, count, lane", [("", "gw1", "2", (1, 2)), ("1/2", "gw0", "2", (2, 4)),
                                                     ("1/2", "gw1", "2", (3, 4)), ("0/2", "gw0", "1", (0, 2))])
def test_pytest_xdist_workers_split_their_runs_ports(monkeypatch, spec, worker, count, lane):
    """scripts/test.sh's in-process tests on two workers: each worker takes its own part of its run's slice."""
    monkeypatch.setenv("PRECISION_LORA_PORT_LANE", spec)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
    assert ports.lane() == lane
    run = ports.lane_range(*(int(x) for x in spec.split("/"))) if spec else ports.lane_range(0, 1)
    mine = ports.lane_range(*lane)
    assert set(mine) <= set(run) and all(ports.free_port() in mine for _ in range(50))
