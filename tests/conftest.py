"""Root test configuration: import paths, markers, and the tiers' shared options.

The pack's pure packages (attention/, training/, lora/, probe/) are importable by name
(scripts/pure_packages.py). nodes/ and demo/ import ComfyUI: tests/comfy loads the pack through
ComfyUI's custom-node loader (see tests/comfy/conftest.py).
"""
from __future__ import annotations

import glob
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
for path in (os.path.join(ROOT, "scripts"), TESTS, ROOT):
    if path not in sys.path:
        sys.path.append(path)

import pure_packages  # noqa: E402  (scripts/: the pure packages by their short names)

pure_packages.install()


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine); run on a GPU host with -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def frontend_args() -> list[str]:
    """``--front-end-root DIR`` when PRECISION_LORA_FRONTEND=DIR names another frontend's static folder (scripts/
    test.sh's run on the newest PyPI frontend, unpacked by scripts/setup.sh into .hosts/frontends/<version>/static)."""
    root = os.environ.get("PRECISION_LORA_FRONTEND")
    if not root:
        return []
    if not os.path.isfile(os.path.join(root, "index.html")):
        pytest.fail(f"PRECISION_LORA_FRONTEND={root} is not a frontend's static folder (no index.html): "
                    "bash scripts/setup.sh unpacks the newest one into .hosts/frontends/<version>/static")
    return ["--front-end-root", os.path.abspath(root)]


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory):
    """One real ComfyUI server (this pack + tiny demo models) for the whole session (e2e and browser), with the
    other packs users commonly run beside it (ComfyUI-GGUF, ComfyUI-KJNodes: tests/other_packs.py) installed."""
    import other_packs
    from server_harness import ComfyServer

    base = str(tmp_path_factory.mktemp("comfy_server_base"))
    # Test-only custom nodes (no nodes, never shipped), tests/*_standin.py: each lets ComfyUI's detection know a
    # tiny stand-in of a real family (e.g. sdxl_standin.py: the tiny SDXL UNet, so that the stock
    # CheckpointLoaderSimple loads its checkpoint for the SDXL workflows).
    os.makedirs(os.path.join(base, "custom_nodes"), exist_ok=True)
    for standin in sorted(glob.glob(os.path.join(TESTS, "*_standin.py"))):
        os.symlink(standin, os.path.join(base, "custom_nodes", "precision_" + os.path.basename(standin)))
    other_packs.install(base)
    server = ComfyServer.start(base, extra_args=frontend_args())
    try:
        errors = server.pack_import_errors()
        if errors:
            pytest.fail("the pack failed to import in ComfyUI:\n" + "\n".join(errors))
        yield server
    finally:
        server.stop()


@pytest.fixture
def server(comfy_server):
    """The session server; fails the test if the pack (or a module of it) reported an import failure."""
    errors = comfy_server.pack_import_errors()
    if errors:
        pytest.fail("the pack failed to import in ComfyUI:\n" + "\n".join(errors))
    return comfy_server
