"""The training job slot: the one training run of this process, its control requests and loss history.

``PrecisionTrainLoRA`` starts a job here and polls it for stop / checkpoint requests between steps; the
HTTP routes (``routes.py``) queue those requests and serve the history. Free of ComfyUI and aiohttp.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class TrainJob:
    """The training job that runs now (or ran last): its owner, control requests and loss history."""

    def __init__(self, node_id: str | None, prompt_id: str | None, points: list[dict],
                 client_id: str | None = None) -> None:
        self.node_id, self.prompt_id, self.client_id = node_id, prompt_id, client_id
        self.points = list(points)
        self.running = True
        self.step = points[-1]["step"] if points else 0
        self._pending: set[str] = set()
        self._writing = False  # a checkpoint is handed out or being written
        self._lock = threading.Lock()

    def owned_by(self, client_id: object) -> bool:
        return self.client_id is not None and isinstance(client_id, str) and client_id == self.client_id

    def request(self, action: str) -> bool:
        """Queue ``action``; returns True when it was coalesced into one already pending or being written."""
        with self._lock:
            if action in self._pending or (action == "checkpoint" and self._writing):
                return True  # the checkpoint being written now is the one asked for
            self._pending.add(action)
            return False

    def take_request(self) -> str | None:
        """The next action for the loop: stop wins over a pending checkpoint."""
        with self._lock:
            if "stop" in self._pending:
                self._pending.clear()
                return "stop"
            if "checkpoint" in self._pending:
                self._pending.discard("checkpoint")
                self._writing = True
                return "checkpoint"
            return None

    def tracked(self, save: Callable[[Any, str], str]) -> Callable[[Any, str], str]:
        """``save`` (the loop's checkpoint writer) marking the job as writing while it runs."""
        def write(state: Any, reason: str) -> str:
            with self._lock:
                self._writing = True
            try:
                return save(state, reason)
            finally:
                with self._lock:
                    self._writing = False
        return write

    def add_point(self, point: dict) -> None:
        with self._lock:
            self.points.append(point)
            self.step = point["step"]

    def snapshot(self) -> dict:
        with self._lock:
            return {"running": self.running, "node_id": self.node_id, "prompt_id": self.prompt_id,
                    "points": [dict(p) for p in self.points]}


class _Slot:
    """The process's one training slot: the job running now (or last) and how many runs ended early."""

    def __init__(self) -> None:
        self.job: TrainJob | None = None
        self.stopped_runs = 0


_SLOT = _Slot()


def start_job(node_id: str | None, prompt_id: str | None, points: list[dict], client_id: str | None = None) -> TrainJob:
    """A new job in the slot (replacing the last one, whose history the routes no longer serve)."""
    job = TrainJob(node_id, prompt_id, points, client_id)
    _SLOT.job = job
    return job


def current_job() -> TrainJob | None:
    return _SLOT.job


def finish_job(job: TrainJob, stopped: bool) -> None:
    """Mark ``job`` as no longer running; ``stopped``: it ended early (Stop, cancel or NaN stop)."""
    job.running = False
    if stopped:
        _SLOT.stopped_runs += 1


def stopped_runs() -> int:
    """How many runs of this process ended early. ``PrecisionTrainLoRA`` fingerprints with it: ComfyUI must
    not serve a stopped run's partial result from its cache when the same graph is queued again (an
    unchanged graph that finished normally stays cached)."""
    return _SLOT.stopped_runs
