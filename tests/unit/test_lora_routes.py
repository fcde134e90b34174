"""The LoRA metadata route: summary, answers and HTTP statuses (its name checks: test_file_names.py).

nodes/lora/routes.py imports ComfyUI only in register(), so it is imported here through the pack
root that scripts/pure_packages.py installs.
"""
from __future__ import annotations

import asyncio
import importlib
import os

import pytest
import torch
from pure_packages import PACK
from safetensors.torch import save_file

lr = importlib.import_module(f"{PACK}.nodes.lora.routes")
fn = importlib.import_module(f"{PACK}.nodes.checks.file_names")

META = {
    "ss_network_dim": "4",
    "ss_network_alpha": "2.0",
    "ss_steps": "30",
    "ss_attn_softmax_scale": "0.0625",
    "ss_attn_mode": "sdpa",
    "ss_base_model_version": "flux1",
}


def _lora(path, metadata=META, rank=4):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tensors = {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(rank, 8),
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(24, rank),
        "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(3.0),
    }
    save_file(tensors, path, metadata=metadata)
    return path


@pytest.fixture()
def tree(tmp_path):
    """Two loras roots, a sub-folder, an outside folder with a secret, and symlinks of each kind."""
    a = tmp_path / "models" / "loras"
    b = tmp_path / "extra" / "loras"
    outside = tmp_path / "outside"
    _lora(str(a / "mine.safetensors"))
    _lora(str(a / "sub" / "deep.safetensors"))
    _lora(str(b / "second.safetensors"))
    _lora(str(outside / "secret.safetensors"))
    (a / "notes.txt").write_text("x")
    os.symlink(outside / "secret.safetensors", a / "link_out.safetensors")
    os.symlink(outside, a / "dir_out")
    os.symlink(a / "mine.safetensors", a / "link_in.safetensors")
    return {"roots": [str(a), str(b)], "a": a, "b": b, "outside": outside}


def test_lookup_returns_metadata_and_summary(tree):
    status, body = lr.lookup("mine.safetensors", tree["roots"])
    assert status == 200
    assert body["name"] == "mine.safetensors"
    assert body["metadata"] == META
    assert body["summary"] == {"rank": "4", "alpha": "2.0", "steps": "30", "softmax_scale": "0.0625",
                               "backend": "sdpa", "base_model": "flux1"}


def test_summary_falls_back_to_tensor_shapes_for_foreign_loras(tmp_path):
    root = tmp_path / "loras"
    _lora(str(root / "foreign.safetensors"), metadata={"format": "pt"}, rank=6)
    status, body = lr.lookup("foreign.safetensors", [str(root)])
    assert status == 200
    assert body["summary"]["rank"] == 6
    assert body["summary"]["alpha"] == 3.0
    assert body["summary"]["softmax_scale"] is None and body["summary"]["backend"] is None


def test_corrupt_file_is_a_clear_422(tmp_path):
    root = tmp_path / "loras"
    root.mkdir()
    (root / "broken.safetensors").write_bytes(b"\xff" * 64)
    status, body = lr.lookup("broken.safetensors", [str(root)])
    assert status == 422
    assert "not a readable safetensors file" in body["error"]


def test_http_handler_answers_with_status_and_json(tree):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        app = web.Application()
        app.router.add_get(lr.ROUTE, fn.handler(lambda: tree["roots"], lr.lookup))
        async with TestClient(TestServer(app)) as client:
            out = {}
            for label, query in {
                "ok": "name=sub%2Fdeep.safetensors",
                "dotdot": "name=..%2Foutside%2Fsecret.safetensors",
                "abs": "name=" + str(tree["outside"] / "secret.safetensors").replace("/", "%2F"),
                "symlink": "name=link_out.safetensors",
                "missing": "name=nope.safetensors",
                "none": "",
            }.items():
                resp = await client.get(f"{lr.ROUTE}?{query}")
                out[label] = (resp.status, await resp.json())
            return out

    out = asyncio.run(run())
    assert out["ok"][0] == 200 and out["ok"][1]["summary"]["steps"] == "30"
    assert out["dotdot"][0] == 403
    assert out["abs"][0] == 403
    assert out["symlink"][0] == 403
    assert out["missing"][0] == 404
    assert out["none"][0] == 400
    for label in ("dotdot", "abs", "symlink", "missing", "none"):
        assert "secret" not in str(out[label][1].get("metadata", "")), label
        assert out[label][1]["error"].startswith("[Precision LoRA]")
