"""The training control/history routes over aiohttp's test client (no ComfyUI: loaded by file path)."""
from __future__ import annotations

import asyncio
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    spec = importlib.util.spec_from_file_location("precision_train_routes", os.path.join(ROOT, "nodes", "train_routes.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tr = _module()


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
                    resp = await client.get(tr.HISTORY_ROUTE)
                else:
                    resp = await client.post(tr.CONTROL_ROUTE, data=body)
                out.append((resp.status, await resp.json()))
        return out

    return asyncio.run(run())


def test_control_without_a_running_job_is_409():
    out = _drive(None, [("POST", '{"action": "stop"}'), ("GET", None)])
    assert out[0] == (409, {"ok": False, "error": "no training is running"})
    assert out[1] == (200, {"running": False, "node_id": None, "prompt_id": None, "points": []})


def test_control_requests_reach_the_running_job_in_order():
    job = tr.TrainJob("7", "p1", [{"step": 1, "loss": 0.5, "lr": 1e-4, "sigma": 0.3}])
    out = _drive(job, [("POST", '{"action": "checkpoint"}'), ("POST", '{"action": "stop", "node_id": "7"}')])
    assert out[0] == (200, {"ok": True, "action": "checkpoint", "node_id": "7", "step": 1})
    assert out[1][0] == 200 and out[1][1]["action"] == "stop"
    assert job.take_request() == "stop"  # stop wins over a pending checkpoint
    job.add_point({"step": 2, "loss": None, "lr": 1e-4, "sigma": 0.9})
    history = _drive(job, [("GET", None)])[0][1]
    assert history["running"] is True and history["prompt_id"] == "p1"
    assert [p["step"] for p in history["points"]] == [1, 2] and history["points"][1]["loss"] is None


def test_bad_bodies_and_other_nodes_are_refused():
    job = tr.TrainJob("7", "p1", [])
    out = _drive(job, [("POST", "not json"), ("POST", '{"action": "delete", "path": "/etc"}'),
                       ("POST", '{"action": "stop", "node_id": "8"}')])
    assert out[0][0] == 400 and "body must be JSON" in out[0][1]["error"]
    assert out[1] == (400, {"ok": False, "error": "action 'delete' is unknown; use one of ['stop', 'checkpoint']"})
    assert out[2] == (409, {"ok": False, "error": "node 8 is not training now (node 7 is)"})
    assert job.take_request() is None


def test_finished_job_refuses_control_but_keeps_history():
    job = tr.TrainJob("3", "p9", [{"step": 1, "loss": 1.0, "lr": 1e-3, "sigma": 0.5}])
    job.running = False
    out = _drive(job, [("POST", '{"action": "stop"}'), ("GET", None)])
    assert out[0][0] == 409
    assert out[1][1]["running"] is False and len(out[1][1]["points"]) == 1
