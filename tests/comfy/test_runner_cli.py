"""scripts/train.py's command line: which ComfyUI it picks from where the pack sits, ComfyUI options after
``--``, and one GPU per torchrun local rank (no ComfyUI import needed for these)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from comfy_harness import ROOT


@pytest.fixture
def cli():
    spec = importlib.util.spec_from_file_location("precision_train_cli", os.path.join(ROOT, "scripts", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_comfyui_holding_the_pack_is_found(cli, tmp_path, monkeypatch) -> None:
    comfy = tmp_path / "ComfyUI"
    pack = comfy / "custom_nodes" / "any-name-at-all"
    pack.mkdir(parents=True)
    monkeypatch.setattr(cli, "ROOT", str(pack))
    assert cli._comfy_dir(None) is None  # no main.py: not a ComfyUI folder
    (comfy / "main.py").write_text("")
    assert cli._comfy_dir(None) == str(comfy)
    assert cli._comfy_dir(str(tmp_path / "other")) == str(tmp_path / "other")  # --comfyui wins


def test_comfyui_options_follow_a_double_dash(cli) -> None:
    args = cli._args(["wf.json", "--steps", "5", "--", "--output-directory", "/x", "--steps", "9"])
    assert (args.workflow, args.steps, args.resume) == ("wf.json", 5, None)
    assert args.comfy_args == ["--output-directory", "/x", "--steps", "9"]
    assert cli._args(["wf.json"]).comfy_args == []
    with pytest.raises(SystemExit):
        cli._args(["wf.json", "--output-directory", "/x"])  # a ComfyUI option without -- is refused


def test_each_local_rank_gets_its_own_gpu(cli, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    # set (to "no list"), not deleted: monkeypatch only restores what it recorded, and _pin_gpu writes the
    # variable, which would otherwise leak into every later subprocess of this test session (torchrun ranks)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cli._pin_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")  # the user's own list is indexed, not replaced
    cli._pin_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(SystemExit, match="lists fewer GPUs"):
        cli._pin_gpu()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    cli._pin_gpu()  # one process: left alone
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
