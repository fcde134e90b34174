"""The pack's metadata has one source each: pyproject.toml's dependencies are requirements.txt's, and the
Comfy Registry's own check (``comfy node validate``, from comfy-cli) passes with no warning.

comfy-cli lives in its own venv, ``.hosts/tools/venv`` (``scripts/setup.sh`` installs it), so that its
requirements never touch a host's pinned ComfyUI packages. It runs offline: it reads pyproject.toml and runs
ruff's security rules over the checkout.
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml with tomllib")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFY = os.path.join(ROOT, ".hosts", "tools", "venv", "bin", "comfy")


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirement(line: str) -> tuple[str, str]:
    """(normalised name, version specifier) of one requirement line, as pip compares names (PEP 503)."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;#]*?)\s*(;.*)?", line)
    assert m, f"cannot read the requirement {line!r}"
    return re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(3).replace(" ", "")


def requirements_txt(text: str) -> set[tuple[str, str]]:
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return {_requirement(line) for line in lines if line}


def test_requirement_lines_are_read_as_pip_reads_them():
    text = "# comment\nsafetensors\n\nNumPy>=1.0  # why\ngoogle_re2 >= 1.1\npytorch-optimizer==4.1.0\n"
    assert requirements_txt(text) == {("safetensors", ""), ("numpy", ">=1.0"), ("google-re2", ">=1.1"),
                                      ("pytorch-optimizer", "==4.1.0")}


def test_pyproject_dependencies_are_requirements_txt():
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as f:
        wanted = requirements_txt(f.read())
    declared = {_requirement(d) for d in _pyproject()["project"]["dependencies"]}
    assert declared == wanted, f"pyproject.toml only: {sorted(declared - wanted)}; requirements.txt only: " \
                               f"{sorted(wanted - declared)}"
    # torch comes with ComfyUI, built for the user's GPU: the pack must not ask pip for another one
    assert "torch" not in {name for name, _ in wanted}


def test_registry_fields_are_filled():
    project, comfy = _pyproject()["project"], _pyproject()["tool"]["comfy"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert project["name"] == "comfyui-precision-lora" and project["description"] and project["license"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    assert {"Icon", "includes", "requires-comfyui"} <= set(comfy)
    for path in comfy["includes"]:
        assert os.path.exists(os.path.join(ROOT, path)), path


def test_comfy_node_validate_passes_without_warnings(tmp_path):
    assert os.path.isfile(COMFY), f"{COMFY} is missing: run bash scripts/setup.sh (it installs comfy-cli there)"
    # HOME: comfy-cli writes its settings file under ~/.config; keep it out of the user's home
    env = {**os.environ, "HOME": str(tmp_path)}
    done = subprocess.run([COMFY, "--skip-prompt", "--no-enable-telemetry", "node", "validate"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "All validation checks passed successfully" in output, output
    warnings = [line for line in output.splitlines() if re.search(r"warning|error|\b[A-Z]\d{3,4}\b", line, re.I)]
    assert not warnings, output
