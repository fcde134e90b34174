"""Free loopback ports for the test servers and torchrun rendezvous, safe when scripts/test.sh runs the hosts'
pytest runs side by side.

A port from ``bind(0)`` is free only until its socket closes; two runs side by side could be handed the same one
and a test of one host would then talk to the other host's server. scripts/test.sh gives each run a lane,
``PRECISION_LORA_PORT_LANE=<i>/<n>``, and a run takes ports only from its own slice of 20000-32767 (below Linux's
ephemeral range, 32768-60999, so no ``bind(0)`` elsewhere takes them either): the runs never share a port. Without
the variable (one run) the slice is the whole range. pytest-xdist workers split their run's slice again.
"""
from __future__ import annotations

import os
import random
import socket


def lane() -> tuple[int, int]:
    """(i, n) from PRECISION_LORA_PORT_LANE; (0, 1) when unset. A malformed value is an error, not ignored. Under
    pytest-xdist (scripts/test.sh's in-process tests on several workers) each worker takes its own part of the
    lane (PYTEST_XDIST_WORKER gw<k> of PYTEST_XDIST_WORKER_COUNT)."""
    spec = os.environ.get("PRECISION_LORA_PORT_LANE", "").strip()
    i, n = 0, 1
    if spec:
        try:
            i, n = (int(x) for x in spec.split("/"))
        except ValueError:
            raise ValueError(f"PRECISION_LORA_PORT_LANE={spec!r}: expected '<lane>/<lanes>', e.g. '1/2'") from None
        if not 0 <= i < n:
            raise ValueError(f"PRECISION_LORA_PORT_LANE={spec!r}: the lane must be 0..{n - 1}")
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and workers.isdigit() and int(workers) > 1:
        k, m = int(worker[2:]), int(workers)
        return i * m + k, n * m
    return i, n


LOW, HIGH = 20000, 32768


def lane_range(i: int, n: int) -> range:
    width = (HIGH - LOW) // n
    return range(LOW + i * width, LOW + (i + 1) * width)


def free_port(tries: int = 500) -> int:
    """A loopback port free now, from this run's lane."""
    ports = lane_range(*lane())
    for _ in range(tries):
        port = random.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port in {ports.start}-{ports.stop - 1} after {tries} tries")
