"""ComfyUI's own validation of pack nodes, through a real server's /prompt (issue 22).

Item 1: during validation ComfyUI hands a linked input over as ``(None,)`` (input-list nodes get the tuple
itself); the pack's input gate treats it as "not known yet" and checks the real value at execution.
"""
from __future__ import annotations

import json
import os
import uuid

import pytest
import safetensors.torch
import torch
from PIL import Image

from training.settings import TrainSettings

pytestmark = pytest.mark.e2e

COSMOS = "precision_tiny_cosmos.safetensors"
ATTACH = dict(rank=4, alpha=4.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
              dry_run=False, init_lora="none")
DATASET = "validation_e2e_dataset"
SIZES = [(80, 48), (48, 80)]  # landscape and portrait: two buckets
CAPTIONS = ["a red square", "a blue square"]


def post(server, prompt: dict) -> tuple[int, dict]:
    """(HTTP status, body) of POST /prompt, without raising on a refusal."""
    return server.request("/prompt", {"prompt": prompt, "client_id": str(uuid.uuid4())})


def node_errors(body: dict, node: str) -> list[dict]:
    return body.get("node_errors", {}).get(node, {}).get("errors", [])


@pytest.fixture(scope="module")
def dataset(comfy_server) -> str:
    """A folder of two captioned images in the server's input folder (what LoadImageTextDataSetFromFolder reads)."""
    folder = os.path.join(comfy_server.base_dir, "input", DATASET)
    os.makedirs(folder, exist_ok=True)
    for i, ((w, h), text) in enumerate(zip(SIZES, CAPTIONS)):
        Image.new("RGB", (w, h), (200 * (i == 0), 0, 200 * (i == 1))).save(os.path.join(folder, f"img{i}.png"))
        with open(os.path.join(folder, f"img{i}.txt"), "w") as f:
            f.write(text)
    return DATASET


def _buckets_prompt(folder: str, **inputs) -> dict:
    return {
        "1": {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": folder}},
        "2": {"class_type": "PrecisionResolutionBuckets", "inputs": {
            "images": ["1", 0], "texts": ["1", 1], "resolution": 64, "multiple": 16, "max_upscale": 2.0, **inputs}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 2]}},
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}},
    }


def test_buckets_with_linked_texts_are_accepted_and_run(server, dataset):
    """Issue 22 item 1: the documented wiring loader -> buckets (texts linked) was refused with
    "input 'texts'=(None,) is not text (got tuple)"."""
    entry = server.run(_buckets_prompt(dataset))
    (report,) = entry["outputs"]["3"]["text"]
    assert report.startswith("2 images -> 2 buckets of about 64^2 px: "), report
    assert "80x48 (1)" in report and "48x80 (1)" in report and "multiple 16 px" in report, report
    assert sorted(entry["outputs"]["4"]["text"]) == sorted(CAPTIONS)


def test_buckets_with_every_widget_linked_are_accepted_and_use_the_linked_values(server, dataset):
    prompt = _buckets_prompt(dataset, resolution=["5", 0], multiple=["6", 0], max_upscale=["7", 0])
    prompt["5"] = {"class_type": "PrimitiveInt", "inputs": {"value": 128}}
    prompt["6"] = {"class_type": "PrimitiveInt", "inputs": {"value": 32}}
    prompt["7"] = {"class_type": "PrimitiveFloat", "inputs": {"value": 3.0}}
    entry = server.run(prompt)
    (report,) = entry["outputs"]["3"]["text"]
    assert report.startswith("2 images -> ") and "about 128^2 px" in report and "multiple 32 px" in report, report


def test_a_linked_bad_value_is_refused_at_execution_naming_node_input_and_value(server, dataset):
    """Skipped at validation (not known yet), the real value still goes through the gate before the node runs."""
    prompt = _buckets_prompt(dataset, resolution=["5", 0])
    prompt["5"] = {"class_type": "PrimitiveInt", "inputs": {"value": 63}}
    entry = server.wait(server.post_prompt(prompt))
    assert entry["status"]["status_str"] == "error"
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert errors and errors[0]["node_id"] == "2", errors
    assert "PrecisionResolutionBuckets: input 'resolution'=63 is below the minimum 64" in errors[0]["exception_message"]


def test_a_literal_bad_value_is_still_refused_at_validation(server, dataset):
    status, body = post(server, _buckets_prompt(dataset, max_upscale=float("nan")))
    assert status == 400
    details = " | ".join(e["details"] for e in node_errors(body, "2"))
    assert "PrecisionResolutionBuckets: input 'max_upscale'=nan is not a finite number; use a value in [1, 16]" \
        in details, json.dumps(body)[:2000]


def _train_prompt(steps, seed, name, prefix: str) -> dict:
    settings = TrainSettings(learning_rate=1e-2, checkpoint_every=3).to_dict()
    return {
        "1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": COSMOS, "weight_dtype": "fp32"}},
        "2": {"class_type": "PrecisionAttachLoRA", "inputs": {"model": ["1", 0], **ATTACH}},
        "3": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["1", 0], "text": "sks", "seed": 0,
                                                                    "tokens": 8}},
        "4": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["1", 0], "width": 32, "height": 32,
                                                              "batch_size": 1, "seed": 1}},
        "5": {"class_type": "PrecisionTrainSettings", "inputs": settings},
        "6": {"class_type": "PrecisionTrainLoRA", "inputs": {
            "model": ["2", 0], "latents": ["4", 0], "conditioning": ["3", 0], "settings": ["5", 0],
            "steps": steps, "seed": seed, "name": name}},
        "7": {"class_type": "PrecisionSaveLoRA", "inputs": {
            "model": ["6", 0], "filename_prefix": prefix, "folder": "loras", "save_dtype": "fp32",
            "key_style": "auto", "use_counter": True, "overwrite": False}},
    }


def test_train_lora_with_steps_name_and_seed_linked_from_primitive_nodes(server):
    """Issue 22 item 1: Train LoRA's steps/name/seed from PrimitiveInt / PrimitiveString were refused with
    "input 'steps'=(None,) is not an integer (got tuple)". Linked, they train exactly like the same literals."""
    run = f"linked_{uuid.uuid4().hex[:8]}"
    linked = _train_prompt(["10", 0], ["11", 0], ["12", 0], f"{run}/linked")
    linked.update({"10": {"class_type": "PrimitiveInt", "inputs": {"value": 3}},
                   "11": {"class_type": "PrimitiveInt", "inputs": {"value": 7}},
                   "12": {"class_type": "PrimitiveString", "inputs": {"value": run}}})
    status, body = post(server, linked)
    assert status == 200, json.dumps(body)[:3000]
    entry = server.wait(body["prompt_id"])
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    literal = server.run(_train_prompt(3, 7, f"{run}_literal", f"{run}/literal"))
    (a,), (b,) = entry["outputs"]["7"]["text"], literal["outputs"]["7"]["text"]
    with safetensors.safe_open(a, "pt") as f:
        assert f.metadata()["ss_steps"] == "3"
    ours, ref = safetensors.torch.load_file(a), safetensors.torch.load_file(b)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
    assert any(k.endswith("lora_up.weight") and ours[k].abs().max() > 0 for k in ours), "the LoRA did not train"
    # the linked name is the run's name: its checkpoint folder and file
    assert os.path.isfile(os.path.join(server.base_dir, "models", "loras", run, f"{run}_step000003.safetensors"))


def test_train_lora_literal_bad_values_are_still_refused_at_validation(server):
    status, body = post(server, _train_prompt(0, 0, "ok_name", "bad_steps/lora"))
    assert status == 400
    details = " | ".join(e["details"] for e in node_errors(body, "6"))
    assert "PrecisionTrainLoRA: input 'steps'=0 is below the minimum 1" in details, json.dumps(body)[:2000]


ONE_BAD_VALUE = [
    # node of _train_prompt, input, bad value, the message ComfyUI's answer must carry once
    ("5", "learning_rate", float("nan"), "PrecisionTrainSettings: input 'learning_rate'=nan is not a finite number"),
    ("5", "optimizer", "sgd_typo", "PrecisionTrainSettings: input 'optimizer'='sgd_typo' is not an option"),
    ("7", "filename_prefix", "../escape", "PrecisionSaveLoRA: input 'filename_prefix'='../escape' contains '..'"),
    ("2", "include", "(", "PrecisionAttachLoRA: include regex '(' is invalid"),
    ("6", "steps", 0, "PrecisionTrainLoRA: input 'steps'=0 is below the minimum 1"),
    ("6", "name", "a/b", "PrecisionTrainLoRA: input 'name'='a/b' must be a plain file name"),
]


@pytest.mark.parametrize("node, name, bad, message", ONE_BAD_VALUE, ids=[f"{c[0]}-{c[1]}" for c in ONE_BAD_VALUE])
def test_one_bad_value_gives_one_error_under_its_input(server, node, name, bad, message):
    """Issue 22 item 7: ComfyUI filed the gate's one message under every input of the node (Train Settings:
    one entry per setting); the answer now has it once, under the input at fault."""
    prompt = _train_prompt(3, 0, "one_error", "one_error/lora")
    prompt[node]["inputs"][name] = bad
    status, body = post(server, prompt)
    assert status == 400
    assert set(body["node_errors"]) == {node}, json.dumps(body)[:2000]
    (error,) = node_errors(body, node)
    assert error["type"] == "custom_validation_failed" and error["extra_info"]["input_name"] == name, error
    assert error["details"].startswith(f"{name} - [Precision LoRA] {message}"), error


def test_two_bad_values_give_two_errors_each_under_its_input_and_host_errors_stay(server, dataset):
    """A message per problem: the gate reports the first bad value of a node; ComfyUI's own entries (a
    missing input) are left as they are."""
    prompt = _buckets_prompt(dataset, max_upscale=float("nan"))
    del prompt["2"]["inputs"]["resolution"]
    prompt["5"] = {"class_type": "PrecisionSaveLoRA", "inputs": {
        "model": ["6", 0], "filename_prefix": "/abs", "folder": "loras", "save_dtype": "fp32", "key_style": "auto",
        "use_counter": True, "overwrite": False}}
    prompt["6"] = {"class_type": "PrecisionLoadDiffusionModel",
                   "inputs": {"model_name": COSMOS, "weight_dtype": "fp32"}}
    status, body = post(server, prompt)
    assert status == 400
    buckets = node_errors(body, "2")
    kinds = sorted((e["type"], e["extra_info"]["input_name"]) for e in buckets)
    assert kinds == [("custom_validation_failed", "max_upscale"), ("required_input_missing", "resolution")], buckets
    (save,) = node_errors(body, "5")
    assert save["extra_info"]["input_name"] == "filename_prefix" and "is an absolute path" in save["details"], save


def _files(base: str) -> set[str]:
    """Every file under the server's folders a prompt could write to (models, output, input, temp)."""
    found = set()
    for top in ("models", "output", "input", "temp"):
        for folder, _dirs, files in os.walk(os.path.join(base, top)):
            found.update(os.path.join(folder, f) for f in files)
    return found


REFUSED = [
    # node of _train_prompt, input, value, what the message says after "<Node>: input '<input>'=<value> "
    ("6", "name", "CON", "has the part 'CON', a Windows device name"),
    ("6", "name", ".", "has the part '.', which names a folder, not a file"),
    ("6", "name", "run\u202eftl",
     "contains the invisible formatting character '\\u202e' (U+202E RIGHT-TO-LEFT OVERRIDE)"),
    ("6", "name", "run\u200b", "contains the invisible formatting character '\\u200b' (U+200B ZERO WIDTH SPACE)"),
    ("7", "filename_prefix", "sub/lora\x85", "contains the control character '\\x85' (U+0085)"),
    ("7", "filename_prefix", "sub/lora\u2028",
     "contains the line separator character '\\u2028' (U+2028 LINE SEPARATOR)"),
    ("7", "filename_prefix", "sub/lora.", "has the part 'lora.' ending in a dot or space"),
    ("7", "filename_prefix", "aux.txt/lora", "has the part 'aux.txt', a Windows device name"),
    ("7", "filename_prefix", "lora\ud800", "contains the lone UTF-16 surrogate '\\ud800' at character 4"),
    ("3", "text", "sks\udfff", "contains the lone UTF-16 surrogate '\\udfff' at character 3"),
    ("2", "include", "x\ud800", "contains the lone UTF-16 surrogate '\\ud800' at character 1"),
]


@pytest.mark.parametrize("node, name, bad, says", REFUSED, ids=[f"{c[1]}-{ascii(c[2])}" for c in REFUSED])
def test_unsafe_names_and_broken_text_are_refused_at_validation_and_nothing_is_written(server, node, name, bad, says):
    """Issue 22 items 4 and 5, through /prompt: refused naming node, input, value (escaped) and fix; no file."""
    prompt = _train_prompt(3, 0, "refused_run", "refused/lora")
    prompt[node]["inputs"][name] = bad
    before = _files(server.base_dir)
    status, body = post(server, prompt)
    assert status == 400, body
    (error,) = node_errors(body, node)
    details = error["details"]
    assert error["extra_info"]["input_name"] == name
    assert f"[Precision LoRA] {prompt[node]['class_type']}: input '{name}'={ascii(bad)} {says}" in details, details
    assert "; " in details.split(says, 1)[1] or "retype" in details  # the fix
    assert _files(server.base_dir) == before


def test_500_nested_groups_in_include_are_refused_without_a_recursion_error(server):
    prompt = _train_prompt(3, 0, "nested_run", "nested/lora")
    prompt["2"]["inputs"]["include"] = "(" * 500 + ")" * 500
    status, body = post(server, prompt)
    assert status == 400
    (error,) = node_errors(body, "2")
    assert error["extra_info"]["input_name"] == "include"
    assert "PrecisionAttachLoRA: include regex '((((" in error["details"]
    assert "nests groups 500 deep: use at most 100 levels" in error["details"], error
    assert "recursion" not in json.dumps(body).lower()


# ---- issue 22 item 8: the host's dataset loader and folders outside input/ (docs/workflows.md) ----------------

def _host_version(server) -> tuple[int, ...]:
    status, stats = server.get("/system_stats")
    assert status == 200
    return tuple(int(p) for p in stats["system"]["comfyui_version"].split(".")[:3])


@pytest.fixture(scope="module")
def outside_folder(comfy_server) -> str:
    """A captioned image in a folder beside (not inside) the server's input/."""
    folder = os.path.join(comfy_server.base_dir, "outside_input")
    os.makedirs(folder, exist_ok=True)
    Image.new("RGB", (32, 32), (0, 255, 0)).save(os.path.join(folder, "secret.png"))
    with open(os.path.join(folder, "secret.txt"), "w") as f:
        f.write("a caption outside input")
    return folder


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_host_loader_outside_input_reads_on_0_3_75_and_is_refused_on_0_33(server, outside_folder, how):
    """What docs/workflows.md says: ComfyUI 0.3.75's LoadImageTextDataSetFromFolder reads any folder the server
    can (its V3 combo is not checked, the path is joined as given); 0.33 refuses. A host limit: the pack cannot
    change that node."""
    folder = "../outside_input" if how == "relative" else outside_folder
    prompt = {"1": {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": folder}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 1]}}}
    if _host_version(server) >= (0, 33, 0):
        status, body = post(server, prompt)
        assert status == 400 and node_errors(body, "1")[0]["type"] == "value_not_in_list", body
    else:
        entry = server.run(prompt)
        assert entry["outputs"]["2"]["text"] == ["a caption outside input"]


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_the_pack_loader_refuses_folders_outside_input_on_both_hosts(server, outside_folder, how):
    """The guard the pack can give: Precision Load Image Dataset, a drop-in for the host's loader, refuses them."""
    folder = "../outside_input" if how == "relative" else outside_folder
    prompt = {"1": {"class_type": "PrecisionLoadImageDataset", "inputs": {
                  "folder": folder, "alpha": "white", "animated": "first_frame", "missing_caption": "train_empty"}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 1]}}}
    status, body = post(server, prompt)
    assert status == 400
    (error,) = node_errors(body, "1")
    assert error["extra_info"]["input_name"] == "folder"
    details = error["details"]
    assert f"PrecisionLoadImageDataset: input 'folder'={folder[:40]!r}"[:-1] in details, error  # long values shortened
    assert " is not an option; choose one of [" in details, error


def test_resume_from_with_a_linked_training_state_is_refused_at_validation_naming_both(server):
    """A linked training_state has no value during validation; connected is enough for the rule."""
    prompt = _train_prompt(3, 0, "both_set", "both_set/lora")
    prompt["11"] = {"class_type": "PrecisionTrainLoRA", "inputs": {
        **prompt["6"]["inputs"], "model": ["6", 0], "training_state": ["6", 1], "name": "both_set_2",
        "resume_from": "both_set/both_set_step000003.safetensors"}}
    prompt["7"]["inputs"]["model"] = ["11", 0]
    status, body = post(server, prompt)
    assert status == 400
    (error,) = node_errors(body, "11")
    assert error["extra_info"]["input_name"] == "resume_from"
    assert ("PrecisionTrainLoRA: input 'resume_from'='both_set/both_set_step000003.safetensors' and input "
            "'training_state' are both set; clear resume_from or disconnect training_state") in error["details"]


def test_the_frontends_api_prompt_path_gets_one_error_too(server):
    """The page queues through /api/prompt: the same single entry there."""
    prompt = _train_prompt(3, 0, "api_path", "api_path/lora")
    prompt["5"]["inputs"]["weight_decay"] = float("nan")
    status, body = server.request("/api/prompt", {"prompt": prompt, "client_id": str(uuid.uuid4())})
    assert status == 400
    (error,) = node_errors(body, "5")
    assert error["extra_info"]["input_name"] == "weight_decay", error


PATCH = dict(backend="auto", scale_mode="default", scale_value=1.0, stable_beta=2.0, softclamp=0.0, fp32_softmax=False)


@pytest.mark.parametrize("literal, kind", [("x", "MODEL"), ({"samples": "x"}, "LATENT"), (3, "CONDITIONING")])
def test_a_literal_where_a_socket_is_expected_is_refused_by_input_name(server, literal, kind):
    """A value typed into an API prompt where a link belongs (a string as Patch Attention's model, a dict as Train
    LoRA's latents) is refused at validation, naming node, input and type, instead of failing deep inside the node
    ("'str' object has no attribute 'clone'")."""
    prompt = {"1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": COSMOS, "weight_dtype": "fp32"}},
              "2": {"class_type": "PrecisionDemoConditioning",
                    "inputs": {"model": ["1", 0], "text": "x", "seed": 0, "tokens": 8}},
              "3": {"class_type": "PrecisionDemoLatent",
                    "inputs": {"model": ["1", 0], "width": 32, "height": 32, "batch_size": 1, "seed": 0}}}
    if kind == "MODEL":
        prompt["4"] = {"class_type": "PrecisionPatchAttention", "inputs": {"model": literal, **PATCH}}
        prompt["5"] = {"class_type": "PreviewAny", "inputs": {"source": ["4", 1]}}
        node, name = "4", "model"
    else:
        inputs = {"model": ["1", 0], "latents": ["3", 0], "conditioning": ["2", 0], "steps": 1, "seed": 0,
                  "name": "literal_socket"}
        name = "latents" if kind == "LATENT" else "conditioning"
        inputs[name] = literal
        prompt["4"] = {"class_type": "PrecisionTrainLoRA", "inputs": inputs}
        prompt["5"] = {"class_type": "PrecisionSaveLoRA", "inputs": {
            "model": ["4", 0], "filename_prefix": "literal_socket", "folder": "loras", "save_dtype": "fp32",
            "key_style": "auto", "use_counter": True, "overwrite": False}}
        node = "4"
    status, body = post(server, prompt)
    assert status == 400, body
    messages = [e["details"] for e in node_errors(body, node)]
    want = f"input '{name}'={literal!r} is a value typed into the prompt, not a {kind}; connect a {kind} output to it"
    assert any(want in m for m in messages), messages
