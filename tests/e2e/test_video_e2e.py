"""Video training through a real server's /prompt (issue 25 item 4), on the Wan 2.2 5B stand-ins of
tests/wan22_5b_standin.py (a tiny Wan 2.2 5B through stock UNETLoader, the Wan 2.2 VAE at its real size through
stock VAELoader, a tiny umt5-xxl through stock CLIPLoader type wan).

Real video files are written here with PyAV (what ComfyUI's video nodes read with):
- ComfyUI's own Load Video -> Get Video Components gives a 5-frame clip's frames to PrecisionCachedTrainingDataset,
  which encodes them with the Wan 2.2 VAE to one (1, 48, 2, h, w) video latent; Train LoRA trains on it and the
  saved LoRA loads in stock LoraLoaderModelOnly with no key left over;
- the same clip through stock VAE Encode and CLIP Text Encode straight into Train LoRA;
- PrecisionLoadVideoDataset reads a folder with a 7-frame clip (cut to 5 for 4k+1) and a still image (a
  one-frame clip): two clip shapes, trained together;
- a 6-frame clip is refused by the dataset node with the count to trim to.
The last test checks that every input of PrecisionLoadVideoDataset took a non-default value and every frame_rule
option was sent (tests/e2e/options_lib.py's coverage, area "video").
"""
from __future__ import annotations

import copy
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wan22_5b_standin as standin  # noqa: E402
from options_lib import AREAS, NOT_OURS, coverage, unused_options  # noqa: E402

FOLDER, MISSING = "precision_video_e2e", "precision_video_e2e_nocap"
CLIP5, CLIP6 = "precision_video_e2e_5.mp4", "precision_video_e2e_6.mp4"
SENT: list[dict] = []
STEPS = 4


def frames(n: int, side: int = 64, seed: int = 0) -> np.ndarray:
    """A coloured square moving right over a gradient: (n, side, side, 3) uint8, each frame different."""
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, side, dtype=np.float32)[None, :, None] * np.array(rng.uniform(0.3, 1, 3))[None, None]
    out = []
    for t in range(n):
        f = np.broadcast_to(base, (side, side, 3)).copy()
        x = 4 + 3 * t
        f[20:44, x:x + 16] = (230, 40, 40)
        out.append(f.clip(0, 255).astype(np.uint8))
    return np.stack(out)


def write_video(path: str, pixels: np.ndarray, fps: int = 8) -> None:
    import av

    with av.open(path, mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = pixels.shape[2], pixels.shape[1], "yuv420p"
        for f in pixels:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.fixture(scope="module")
def files(comfy_server):
    from PIL import Image
    from server_harness import server_env

    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "wan22_5b_standin.py"), comfy_server.base_dir],
                   check=True, env=server_env(), timeout=900)
    inputs = os.path.join(comfy_server.base_dir, "input")
    for folder in (FOLDER, MISSING):
        os.makedirs(os.path.join(inputs, folder), exist_ok=True)
    write_video(os.path.join(inputs, CLIP5), frames(5))
    write_video(os.path.join(inputs, CLIP6), frames(6))
    write_video(os.path.join(inputs, FOLDER, "a_walk.mp4"), frames(7, seed=1))
    with open(os.path.join(inputs, FOLDER, "a_walk.txt"), "w") as f:
        f.write("a red square moves right")
    Image.fromarray(frames(1, seed=2)[0]).save(os.path.join(inputs, FOLDER, "b_still.png"))
    with open(os.path.join(inputs, FOLDER, "b_still.txt"), "w") as f:
        f.write("a red square")
    write_video(os.path.join(inputs, MISSING, "c_nocap.mp4"), frames(5, seed=3))
    return comfy_server.base_dir


def _train_prompt(images: list, texts: list) -> dict:
    """train_lora.json's attention patch, LoRA and settings (lr 1e-2) on the stand-in Wan 2.2 5B, its VAE and umt5,
    the dataset node fed ``images`` / ``texts`` (links into nodes "20".. added by the caller)."""
    with open(os.path.join(ROOT, "workflows", "api", "train_lora.json")) as f:
        base = json.load(f)
    p = {k: copy.deepcopy(base[k]) for k in ("2", "3", "4", "8", "9", "10")}
    p["1"] = {"class_type": "UNETLoader", "inputs": {"unet_name": standin.MODEL_NAME, "weight_dtype": "default"}}
    p["5"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": standin.CLIP_NAME, "type": "wan", "device": "default"}}
    p["6"] = {"class_type": "VAELoader", "inputs": {"vae_name": standin.VAE_NAME}}
    p["4"]["inputs"]["learning_rate"] = 1e-2
    p["8"]["inputs"].update(images=images, texts=texts, cache="off")
    p["9"]["inputs"].update(steps=STEPS, name="video_e2e")
    p["10"]["inputs"].update(filename_prefix="precision_lora/video_e2e")
    return p


def _run(server, prompt: dict, timeout: float = 900) -> dict:
    entry = server.run(prompt, timeout=timeout)
    SENT.append(copy.deepcopy(prompt))
    return entry


def _failure(server, prompt: dict) -> str:
    entry = server.wait(server.post_prompt(prompt), 600)
    SENT.append(copy.deepcopy(prompt))
    assert entry["status"]["status_str"] == "error", entry["status"]
    return [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"][0]["exception_message"]


def _text(entry: dict, node: str) -> str:
    return "".join(entry["outputs"][node]["text"])


def _saved(base: str) -> set[str]:
    return set(glob.glob(os.path.join(base, "models", "loras", "precision_lora", "video_e2e_*.safetensors")))


def test_load_video_and_get_video_components_train_wan22_on_a_5_frame_clip(server, files):
    p = _train_prompt(["21", 0], ["22", 0])
    p["20"] = {"class_type": "LoadVideo", "inputs": {"file": CLIP5}}
    p["21"] = {"class_type": "GetVideoComponents", "inputs": {"video": ["20", 0]}}
    p["22"] = {"class_type": "PrimitiveString", "inputs": {"value": "a red square moves right"}}
    before = _saved(files)
    entry = _run(server, p)
    report = _text(entry, "8")
    assert "Wan 2.2 video VAE (4k+1 frames)" in report and "frames 5 -> 2 latent" in report, report
    (saved,) = _saved(files) - before
    with safe_open(saved, "pt") as f:
        ups = [f.get_tensor(k) for k in f.keys() if k.endswith("lora_up.weight")]
        assert f.metadata()["ss_steps"] == str(STEPS)
    assert ups and all(float(u.abs().sum()) > 0 for u in ups), "the LoRA did not train"
    # stock LoraLoaderModelOnly applies every key of the file to the stock-loaded model
    name = "precision_lora/" + os.path.basename(saved)
    check = {"1": p["1"], "2": {"class_type": "LoraLoaderModelOnly",
                                "inputs": {"model": ["1", 0], "lora_name": name, "strength_model": 1.0}},
             "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}}}
    start = len(server.log_text())
    _run(server, check)
    log = server.log_text()[start:]
    assert "lora key not loaded" not in log, [ln for ln in log.splitlines() if "not loaded" in ln]


def test_stock_vae_encode_and_clip_text_encode_feed_train_lora_a_video_latent(server, files):
    """No pack dataset node: Load Video -> Get Video Components -> VAE Encode (Wan 2.2 VAE) -> Train LoRA's latents,
    CLIP Text Encode -> its conditioning. The latent is (1, 48, 2, 4, 4): 5 frames of 64 px."""
    p = _train_prompt(["21", 0], ["22", 0])
    del p["8"]
    p["20"] = {"class_type": "LoadVideo", "inputs": {"file": CLIP5}}
    p["21"] = {"class_type": "GetVideoComponents", "inputs": {"video": ["20", 0]}}
    p["23"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["21", 0], "vae": ["6", 0]}}
    p["24"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a red square moves right", "clip": ["5", 0]}}
    p["9"]["inputs"].update(latents=["23", 0], conditioning=["24", 0])
    p["25"] = {"class_type": "SaveLatent", "inputs": {"samples": ["23", 0], "filename_prefix": "video_e2e/clip5"}}
    before = _saved(files)
    entry = _run(server, p)
    (item,) = entry["outputs"]["25"]["latents"]
    with safe_open(server.output_path(item["subfolder"], item["filename"]), "pt") as f:
        assert tuple(f.get_tensor("latent_tensor").shape) == (1, 48, 2, 4, 4)
    assert len(_saved(files) - before) == 1


def test_video_folder_with_a_clip_and_a_still_trains_in_two_shapes(server, files):
    p = _train_prompt(["20", 0], ["20", 1])
    p["20"] = {"class_type": "PrecisionLoadVideoDataset",
               "inputs": {"folder": FOLDER, "frame_rule": "4k+1 (Wan, HunyuanVideo)", "max_frames": 17,
                          "frame_stride": 1, "missing_caption": "refuse"}}
    p["21"] = {"class_type": "PreviewAny", "inputs": {"source": ["20", 2]}}
    before = _saved(files)
    entry = _run(server, p)
    loaded = _text(entry, "21")
    assert "2 clips from input/precision_video_e2e" in loaded and "2 clip shapes" in loaded, loaded
    assert "a_walk.mp4: 7 frames at 8 fps -> kept the first 5 (the frame rule)" in loaded, loaded
    assert "b_still.png: still image, trains as a one-frame clip" in loaded, loaded
    report = _text(entry, "8")
    assert "frames 1 -> 1 latent, 5 -> 2 latent" in report and "2 captions (2 distinct)" in report, report
    assert len(_saved(files) - before) == 1


def test_a_6_frame_clip_is_refused_with_the_count_to_trim_to(server, files):
    p = _train_prompt(["21", 0], ["22", 0])
    p["20"] = {"class_type": "LoadVideo", "inputs": {"file": CLIP6}}
    p["21"] = {"class_type": "GetVideoComponents", "inputs": {"video": ["20", 0]}}
    p["22"] = {"class_type": "PrimitiveString", "inputs": {"value": "a red square"}}
    message = _failure(server, p)
    for part in ("PrecisionCachedTrainingDataset", "input 'images'", "clip 0", "has 6 frames", "Wan 2.2's VAE",
                 "4k+1 frames", "drop the last 1", "trim the clip to 5 frames"):
        assert part in message, (part, message)


def _loader(folder: str, **change) -> dict:
    inputs = {"folder": folder, "frame_rule": "4k+1 (Wan, HunyuanVideo)", "max_frames": 33, "frame_stride": 1,
              "missing_caption": "train_empty", **change}
    return {"1": {"class_type": "PrecisionLoadVideoDataset", "inputs": inputs},
            "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 2]}}}


@pytest.mark.parametrize("rule,kept", [("8k+1 (LTXV)", 1), ("6k+1 (Mochi)", 7), ("24k+1 (all video families)", 1),
                                       ("any count", 7)])
def test_frame_rules_cut_the_clip(server, files, rule, kept):
    report = _text(_run(server, _loader(FOLDER, frame_rule=rule)), "2")
    line = f"a_walk.mp4: 7 frames at 8 fps -> kept the first {kept}"
    assert (line in report) if kept != 7 else ("a_walk.mp4: 7" not in report), report


def test_stride_max_frames_and_missing_captions(server, files):
    report = _text(_run(server, _loader(FOLDER, frame_stride=2, max_frames=3)), "2")
    assert "a_walk.mp4: frame_stride 2: 3+ frames at 8 fps -> kept the first 1 (the frame rule)" in report, report
    message = _failure(server, _loader(MISSING, missing_caption="refuse"))
    assert "PrecisionLoadVideoDataset" in message and "c_nocap.mp4 has no caption" in message, message
    report = _text(_run(server, _loader(MISSING)), "2")
    assert "c_nocap.mp4: no caption" in report, report


def test_every_video_loader_option_went_through_the_server(server):
    """Runs last: every input of PrecisionLoadVideoDataset took a non-default value in a prompt this module
    queued, and every frame_rule option was sent."""
    info = server.object_info()
    assert "PrecisionLoadVideoDataset.folder" in NOT_OURS
    assert coverage(info, AREAS["video"], SENT) == ([], [])
    assert unused_options(info, AREAS["video"], SENT, set()) == []
