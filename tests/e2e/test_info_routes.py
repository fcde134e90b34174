"""The read-only info routes on the real server: LoRA metadata and model head_dim, and what they refuse."""
from __future__ import annotations

import os
import urllib.parse

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.e2e

ROUTE = "/precision_lora/lora/metadata"
MODEL_ROUTE = "/precision_lora/model/info"


def _q(route: str, name: str) -> str:
    return f"{route}?name={urllib.parse.quote(name, safe='')}"


@pytest.fixture(scope="module")
def lora_tree(comfy_server, tmp_path_factory):
    """A LoRA inside the server's loras folder, a secret outside it and a symlink pointing at the secret."""
    loras = os.path.join(comfy_server.base_dir, "models", "loras")
    outside = tmp_path_factory.mktemp("outside_loras")
    os.makedirs(os.path.join(loras, "e2e_routes"), exist_ok=True)
    tensors = {"lora_unet_x.lora_down.weight": torch.zeros(2, 4), "lora_unet_x.lora_up.weight": torch.zeros(4, 2)}
    inside = os.path.join(loras, "e2e_routes", "inside.safetensors")
    save_file(tensors, inside, metadata={"ss_network_dim": "2", "ss_attn_mode": "sdpa"})
    secret = str(outside / "secret.safetensors")
    save_file(tensors, secret, metadata={"secret": "do not serve"})
    link = os.path.join(loras, "e2e_routes", "link_out.safetensors")
    if not os.path.lexists(link):
        os.symlink(secret, link)
    return {"inside": "e2e_routes/inside.safetensors", "secret": secret, "link": "e2e_routes/link_out.safetensors"}


def test_metadata_of_a_lora_in_the_folder(server, lora_tree):
    status, body = server.get(_q(ROUTE, lora_tree["inside"]))
    assert status == 200, body
    assert body["metadata"] == {"ss_network_dim": "2", "ss_attn_mode": "sdpa"}
    assert body["summary"]["rank"] == "2" and body["summary"]["backend"] == "sdpa"
    status, body = server.get(_q("/api" + ROUTE, lora_tree["inside"]))  # the frontend's /api prefix
    assert status == 200 and body["summary"]["rank"] == "2"


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "missing", "empty"])
def test_metadata_route_refuses_names_outside_the_loras_folders(server, lora_tree, kind):
    name = {
        "dotdot": "../../" + os.path.relpath(lora_tree["secret"], "/"),
        "absolute": lora_tree["secret"],
        "symlink": lora_tree["link"],
        "missing": "e2e_routes/nope.safetensors",
        "empty": "",
    }[kind]
    status, body = server.get(_q(ROUTE, name))
    assert status == {"dotdot": 403, "absolute": 403, "symlink": 403, "missing": 404, "empty": 400}[kind], body
    assert body["error"].startswith("[Precision LoRA] metadata:")
    assert "do not serve" not in str(body)


@pytest.mark.parametrize("model,family,heads,head_dim", [
    ("precision_tiny_flux1_dev.safetensors", "flux1", 2, 32),
    ("precision_tiny_flux2.safetensors", "flux2", 2, 32),
    ("precision_tiny_cosmos.safetensors", "cosmos_predict2", 16, 12),
])
def test_model_info_reports_head_dim_from_the_file_header(server, model, family, heads, head_dim):
    status, body = server.get(_q(MODEL_ROUTE, model))
    assert status == 200, body
    assert (body["family"], body["heads"], body["head_dim"]) == (family, heads, head_dim)
    assert body["default_scale"] == pytest.approx(head_dim ** -0.5)


def test_model_info_refuses_paths_outside_diffusion_models(server, lora_tree):
    for name, want in (("../loras/" + lora_tree["inside"], 403), ("/etc/hostname", 403), ("nope.safetensors", 404)):
        status, body = server.get(_q(MODEL_ROUTE, name))
        assert status == want, (name, body)
        assert body["error"].startswith("[Precision LoRA] model info:")
