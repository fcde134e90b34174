"""What counts as a second copy of the pack, what the pack says about it, and where the scripts may link it.

nodes/host/single_copy.py imports ComfyUI only inside ``skip_second_copy``, so its rules are tested here on
folders made in tmp_path; tests/e2e/test_load_once.py checks them in real servers.
"""
from __future__ import annotations

import importlib
import os
import shutil

import comfy_bootstrap
import make_demo_models
import pytest
from pure_packages import PACK

sc = importlib.import_module(f"{PACK}.nodes.host.single_copy")
ROOT = comfy_bootstrap.ROOT


def _copy_of_pack(folder) -> str:
    """A minimal copy of the pack: its pyproject and an __init__.py (what a clone has among the rest)."""
    os.makedirs(folder)
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), folder)
    shutil.copy(os.path.join(ROOT, "__init__.py"), folder)
    return str(folder)


def _other_pack(folder, name="ComfyUI-KJNodes") -> str:
    os.makedirs(folder)
    with open(os.path.join(folder, "pyproject.toml"), "w") as f:
        f.write('[project]\nversion = "1"\n\n[tool.comfy]\nname = "comfyui-precision-lora"\n\n'
                '[project.urls]\nname = "x"\n')
    open(os.path.join(folder, "__init__.py"), "w").close()
    return str(folder)


def test_project_name_is_read_from_the_project_table_only(tmp_path):
    assert sc.project_name(ROOT) == "comfyui-precision-lora"
    other = _other_pack(tmp_path / "kj")
    assert sc.project_name(other) is None  # a "name" in [tool.comfy] or [project.urls] is not the project's
    assert sc.project_name(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("kind, expected", [
    ("link to the checkout", True), ("copy (same project)", True), ("other pack", False),
    ("copy without __init__.py", False), ("plain file", False), ("dangling link", False),
])
def test_is_pack_copy(tmp_path, kind, expected):
    path = tmp_path / "custom_nodes" / "X"
    os.makedirs(path.parent)
    if kind == "link to the checkout":
        os.symlink(ROOT, path)
    elif kind == "copy (same project)":
        _copy_of_pack(path)
    elif kind == "other pack":
        _other_pack(path)
    elif kind == "copy without __init__.py":
        _copy_of_pack(path)
        os.remove(path / "__init__.py")
    elif kind == "plain file":
        path.write_text("[project]\nname = 'comfyui-precision-lora'\n")
    else:
        os.symlink(tmp_path / "gone", path)
    assert sc.is_pack_copy(str(path), ROOT) is expected


def test_pack_copies_lists_every_copy_and_skips_disabled_folders(tmp_path):
    custom = tmp_path / "custom_nodes"
    os.makedirs(custom)
    os.symlink(ROOT, custom / "comfyui-precision-lora")
    _copy_of_pack(custom / "ComfyUI-Precision-LoRA")
    _copy_of_pack(custom / "old.disabled")
    _other_pack(custom / "ComfyUI-KJNodes")
    assert sc.pack_copies(str(custom), ROOT) == [str(custom / "ComfyUI-Precision-LoRA"),
                                                 str(custom / "comfyui-precision-lora")]
    assert sc.pack_copies(str(tmp_path / "none"), ROOT) == []


def test_the_message_names_both_folders_and_the_link_to_remove(tmp_path):
    clone = _copy_of_pack(tmp_path / "ComfyUI-Precision-LoRA")
    link = str(tmp_path / "comfyui-precision-lora")
    os.symlink(clone, link)
    for loaded, skipped in ((clone, link), (link, clone)):
        text = sc.duplicate_message(loaded, skipped)
        assert text.startswith("[Precision LoRA] the pack is installed twice: ")
        assert f"{loaded}" in text and f"{skipped}" in text and "\n" not in text
        assert f"Remove {link} (or rename it to comfyui-precision-lora.disabled)" in text  # the link, either way
        assert f"{link} (a link to {os.path.realpath(clone)})" in text
    other = _copy_of_pack(tmp_path / "second")
    assert f"Remove {other} " in sc.duplicate_message(clone, other)  # two folders: the one not loaded


def test_earlier_copies_are_the_other_loaded_folders_of_the_pack(tmp_path):
    clone = _copy_of_pack(tmp_path / "a")
    second = _copy_of_pack(tmp_path / "b")
    kj = _other_pack(tmp_path / "kj")
    loaded = {"kj": kj, "a": clone, "b": second}  # nodes.LOADED_MODULE_DIRS: name -> folder
    assert sc.earlier_copies(second, loaded) == [clone]
    assert sc.earlier_copies(clone, {"kj": kj, "a": clone}) == []


def test_unserve_web_removes_only_this_copys_entry(tmp_path):
    first, second = str(tmp_path / "one" / "P"), str(tmp_path / "two")
    web = {"P": os.path.join(first, "web"), "two": os.path.join(second, "web"), "kj": "/x/web"}
    sc.unserve_web(second, [first], web)
    assert web == {"P": os.path.join(first, "web"), "kj": "/x/web"}
    # the same folder name under another custom_nodes path: ComfyUI's key was overwritten; give it back
    again = str(tmp_path / "other_root" / "P")
    web["P"] = os.path.join(again, "web")
    sc.unserve_web(again, [first], web)
    assert web["P"] == os.path.join(first, "web")


def test_link_pack_writes_no_second_link_where_the_pack_is(tmp_path):
    custom = tmp_path / "custom_nodes"
    os.makedirs(custom)
    os.symlink(ROOT, custom / "ComfyUI-Precision-LoRA")  # the clone: this checkout under another name
    assert comfy_bootstrap.link_pack(str(tmp_path)) == str(custom / "ComfyUI-Precision-LoRA")
    assert sorted(os.listdir(custom)) == ["ComfyUI-Precision-LoRA"]


def test_link_pack_leaves_another_copy_alone_and_links_where_there_is_none(tmp_path):
    custom = tmp_path / "custom_nodes"
    copy = _copy_of_pack(custom / "Precision")
    assert comfy_bootstrap.link_pack(str(tmp_path)) == copy
    assert sorted(os.listdir(custom)) == ["Precision"]
    shutil.rmtree(copy)
    os.symlink(tmp_path, custom / comfy_bootstrap.PACK_NAME)  # a stale link of an earlier run: re-pointed
    link = comfy_bootstrap.link_pack(str(tmp_path))
    assert link == str(custom / comfy_bootstrap.PACK_NAME) and os.path.realpath(link) == os.path.realpath(ROOT)


def _comfyui(folder) -> str:
    os.makedirs(folder / "custom_nodes")
    for name in ("main.py", "folder_paths.py"):
        (folder / name).write_text("")
    return str(folder)


def test_find_comfyui_from_the_pack_folder_or_the_current_folder(tmp_path):
    comfy = _comfyui(tmp_path / "ComfyUI")
    script = os.path.join(comfy, "custom_nodes", "ComfyUI-Precision-LoRA", "scripts", "make_demo_models.py")
    assert make_demo_models.find_comfyui(script, str(tmp_path)) == comfy
    elsewhere = str(tmp_path / "checkout" / "scripts" / "make_demo_models.py")
    assert make_demo_models.find_comfyui(elsewhere, comfy) == comfy
    with pytest.raises(SystemExit, match="is not a ComfyUI folder .* Run it from your ComfyUI folder"):
        make_demo_models.find_comfyui(elsewhere, str(tmp_path))
