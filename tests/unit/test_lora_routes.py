"""The LoRA metadata route: name checks (.., absolute paths, symlinks), summary, HTTP answers.

precision_nodes/lora_routes.py imports ComfyUI only in register(), so it is loaded here by file path (the package
name `nodes` would clash with ComfyUI's own nodes module in a mixed test session).
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    name = "precision_lora_routes_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "precision_nodes", "lora_routes.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


lr = _load()

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


def test_names_inside_the_folders_resolve(tree):
    roots = tree["roots"]
    assert lr.resolve_lora_name("mine.safetensors", roots) == os.path.realpath(tree["a"] / "mine.safetensors")
    assert lr.resolve_lora_name("sub/deep.safetensors", roots).endswith(os.path.join("sub", "deep.safetensors"))
    assert lr.resolve_lora_name("sub\\deep.safetensors", roots).endswith(os.path.join("sub", "deep.safetensors"))
    assert lr.resolve_lora_name("second.safetensors", roots) == os.path.realpath(tree["b"] / "second.safetensors")
    # a symlink that stays inside the folder is fine
    assert lr.resolve_lora_name("link_in.safetensors", roots) == os.path.realpath(tree["a"] / "mine.safetensors")


@pytest.mark.parametrize("name", [
    "../outside/secret.safetensors",
    "../../outside/secret.safetensors",
    "sub/../../../outside/secret.safetensors",
    "..\\..\\outside\\secret.safetensors",
    "sub/..",
    "..",
])
def test_dotdot_is_refused(tree, name):
    with pytest.raises(lr.LoraNameError) as e:
        lr.resolve_lora_name(name, tree["roots"])
    assert e.value.status == 403
    assert "'..'" in str(e.value)


def test_absolute_paths_are_refused_even_inside_the_folder(tree):
    inside = str(tree["a"] / "mine.safetensors")
    for name in (inside, str(tree["outside"] / "secret.safetensors"), "/etc/passwd", "C:\\x\\y.safetensors",
                 "c:y.safetensors", "\\\\server\\share\\y.safetensors", "~/y.safetensors"):
        with pytest.raises(lr.LoraNameError) as e:
            lr.resolve_lora_name(name, tree["roots"])
        assert e.value.status == 403, name
        assert "absolute" in str(e.value)


@pytest.mark.parametrize("name", ["link_out.safetensors", "dir_out/secret.safetensors"])
def test_symlinks_leaving_the_folder_are_refused(tree, name):
    with pytest.raises(lr.LoraNameError) as e:
        lr.resolve_lora_name(name, tree["roots"])
    assert e.value.status == 403
    assert "outside the loras folders" in str(e.value)


@pytest.mark.parametrize("name,status", [
    ("", 400), ("   ", 400), (None, 400), ("a\x00.safetensors", 400), ("x" * 2000 + ".safetensors", 400),
    ("notes.txt", 400), ("sub//deep.safetensors", 400), ("missing.safetensors", 404), ("sub/missing.safetensors", 404),
    ("sub", 400),
])
def test_bad_or_missing_names(tree, name, status):
    with pytest.raises(lr.LoraNameError) as e:
        lr.resolve_lora_name(name, tree["roots"])
    assert e.value.status == status
    assert str(e.value).startswith("[Precision LoRA]")


def test_a_directory_named_like_a_lora_is_not_found(tree):
    os.makedirs(tree["a"] / "folder.safetensors")
    with pytest.raises(lr.LoraNameError) as e:
        lr.resolve_lora_name("folder.safetensors", tree["roots"])
    assert e.value.status == 404


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
        app.router.add_get(lr.ROUTE, lr.make_handler(lambda: tree["roots"]))
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
