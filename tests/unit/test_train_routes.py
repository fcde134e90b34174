"""The training control/history routes over aiohttp's test client (no ComfyUI: loaded by file path).

Issue 13: D6 (control had no owner and no limit: any local client could stop or checkpoint another
client's run, 40 checkpoint requests wrote 40 checkpoints, the history showed another client's run) and
D8 (deeply nested JSON made the control route answer HTTP 500).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"precision_train_{name}", os.path.join(ROOT, "nodes", "train", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tr, jobs = _module("routes"), _module("jobs")


def _drive(job, calls):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        app = web.Application()
        app.router.add_post(tr.CONTROL_ROUTE, tr.make_control_handler(lambda: job))
        app.router.add_get(tr.HISTORY_ROUTE, tr.make_history_handler(lambda: job))
        out = []
        async with TestClient(TestServer(app)) as client:
            for method, body in calls:
                if method == "GET":
                    resp = await client.get(tr.HISTORY_ROUTE, params={} if body is None else {"client_id": body})
                else:
                    resp = await client.post(tr.CONTROL_ROUTE, data=body)
                out.append((resp.status, await resp.json()))
        return out

    return asyncio.run(run())


def _body(action="stop", client="me", **extra) -> str:
    return json.dumps({"action": action, "client_id": client, **extra})


def test_control_without_a_running_job_is_409():
    out = _drive(None, [("POST", _body()), ("GET", "me")])
    assert out[0] == (409, {"ok": False, "error": "no training is running"})
    assert out[1] == (200, {"running": False, "node_id": None, "prompt_id": None, "points": []})


def test_control_requests_of_the_owner_reach_the_running_job():
    job = jobs.TrainJob("7", "p1", [{"step": 1, "loss": 0.5, "lr": 1e-4, "sigma": 0.3}], client_id="me")
    out = _drive(job, [("POST", _body("checkpoint")), ("POST", _body("stop", node_id="7"))])
    assert out[0] == (200, {"ok": True, "action": "checkpoint", "node_id": "7", "step": 1, "coalesced": False})
    assert out[1][0] == 200 and out[1][1]["action"] == "stop"
    assert job.take_request() == "stop"  # stop wins over a pending checkpoint
    assert job.take_request() is None
    job.add_point({"step": 2, "loss": None, "lr": 1e-4, "sigma": 0.9})
    history = _drive(job, [("GET", "me")])[0][1]
    assert history["running"] is True and history["prompt_id"] == "p1"
    assert [p["step"] for p in history["points"]] == [1, 2] and history["points"][1]["loss"] is None


def test_another_client_can_neither_control_nor_read_the_run():
    """D6: any local client could stop or checkpoint another client's run and read its prompt id and losses."""
    job = jobs.TrainJob("7", "p1", [{"step": 1, "loss": 0.5, "lr": 1e-4, "sigma": 0.3}], client_id="me")
    out = _drive(job, [("POST", _body("stop", client="intruder")), ("POST", _body("checkpoint", client="intruder")),
                       ("GET", "intruder"), ("GET", None)])
    assert out[0][0] == out[1][0] == 403
    assert "belongs to another client: only the client that queued it can stop or checkpoint it" in out[0][1]["error"]
    assert out[2] == out[3] == (200, {"running": False, "node_id": None, "prompt_id": None, "points": []})
    assert job.take_request() is None


def test_a_run_queued_without_client_id_is_controlled_by_nobody():
    job = jobs.TrainJob("7", "p1", [], client_id=None)
    out = _drive(job, [("POST", _body()), ("POST", json.dumps({"action": "stop"})), ("GET", "me")])
    assert out[0][0] == 403 and "belongs to no client (it was queued without a client_id)" in out[0][1]["error"]
    assert out[1][0] == 400 and out[1][1]["error"].startswith("client_id is missing: send the websocket clientId")
    assert out[2][1]["points"] == [] and job.take_request() is None


def test_checkpoint_requests_are_coalesced_while_one_is_pending_or_being_written():
    """D6: 40 checkpoint requests during a run wrote 40 full checkpoints."""
    job = jobs.TrainJob("7", "p1", [], client_id="me")
    out = _drive(job, [("POST", _body("checkpoint"))] * 40)
    assert [o[1]["coalesced"] for o in out] == [False] + [True] * 39
    assert job.take_request() == "checkpoint" and job.take_request() is None
    written = []

    def save(state, reason):  # while this writes, new requests join it
        written.append(_drive(job, [("POST", _body("checkpoint"))] * 3))
        return "path"

    assert job.tracked(save)("state", "checkpoint") == "path"
    assert [o[1]["coalesced"] for o in written[0]] == [True, True, True]
    assert job.take_request() is None  # all joined the one written
    assert _drive(job, [("POST", _body("checkpoint"))])[0][1]["coalesced"] is False  # after it: a new one


def test_bad_bodies_and_other_nodes_are_refused():
    job = jobs.TrainJob("7", "p1", [], client_id="me")
    out = _drive(job, [("POST", "not json"), ("POST", _body("delete", path="/etc")),
                       ("POST", _body("stop", node_id="8")), ("POST", _body("stop", node_id=[1]))])
    assert out[0][0] == 400 and "body must be JSON" in out[0][1]["error"]
    assert out[1] == (400, {"ok": False, "error": "action 'delete' is unknown; use one of ['stop', 'checkpoint']"})
    assert out[2] == (409, {"ok": False, "error": "node 8 is not training now (node 7 is)"})
    assert out[3][0] == 400 and "node_id must be" in out[3][1]["error"]
    assert job.take_request() is None


def test_deeply_nested_and_oversized_bodies_are_client_errors_not_500():
    """D8: '['*100000 + ']'*100000 raised an uncaught RecursionError (HTTP 500)."""
    job = jobs.TrainJob("7", "p1", [], client_id="me")
    nested = "[" * 2000 + "]" * 2000  # under the size limit, deeper than json's recursion limit
    out = _drive(job, [("POST", nested), ("POST", "[" * 100000 + "]" * 100000),
                       ("POST", _body(pad="x" * 5000))])
    assert out[0][0] == 400 and "body must be JSON" in out[0][1]["error"]
    assert out[1][0] == 413 and out[2][0] == 413 and "longer than 4096 bytes" in out[1][1]["error"]
    assert job.take_request() is None


def test_finished_job_refuses_control_but_keeps_history_for_its_owner():
    job = jobs.TrainJob("3", "p9", [{"step": 1, "loss": 1.0, "lr": 1e-3, "sigma": 0.5}], client_id="me")
    job.running = False
    out = _drive(job, [("POST", _body()), ("GET", "me")])
    assert out[0][0] == 409
    assert out[1][1]["running"] is False and len(out[1][1]["points"]) == 1
