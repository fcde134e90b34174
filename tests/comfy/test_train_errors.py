"""Bad input to the training nodes: a clear error naming node, input, value and fix; nothing written."""
from __future__ import annotations

import os

import pytest
import torch

from models import make_conditioning, make_latent, tiny_cosmos, tiny_flux1


@pytest.fixture(scope="module")
def env(pack_module):
    class E:
        glue = pack_module("nodes.lora.glue")
        train = pack_module("nodes.train.node")
        tglue = pack_module("nodes.train.glue")
        lora = pack_module("lora.config")
        Settings = pack_module("training.settings").TrainSettings
        model = tiny_cosmos()
    with torch.inference_mode():
        E.with_lora = E.glue.attach_lora(E.model, E.lora.LoRAConfig(rank=2, alpha=2))
    E.latent = make_latent(E.model, 1, width=32, height=32)
    E.cond = make_conditioning(E.model, 1)
    return E


def _writable_roots() -> list[str]:
    """Every folder a run could write to: ComfyUI's base, output, temp, input and user folders and every
    registered model folder (checkpoints go to ``models/loras/<name>/``, previews to ``output/``)."""
    import folder_paths

    roots = {folder_paths.base_path, folder_paths.get_output_directory(), folder_paths.get_temp_directory(),
             folder_paths.get_input_directory(), folder_paths.get_user_directory()}
    for name in folder_paths.folder_names_and_paths:
        roots.update(folder_paths.get_folder_paths(name))
    return sorted(os.path.abspath(r) for r in roots)


def _listing() -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file and folder under the writable roots."""
    seen = {}
    for root in _writable_roots():
        for folder, dirs, files in os.walk(root):
            for entry in dirs + files:
                path = os.path.join(folder, entry)
                st = os.lstat(path)
                seen[path] = (st.st_size if entry in files else 0, st.st_mtime_ns)
    return seen


def _train(env, model=None, latents=None, conds=None, steps=2, settings=None, **kw):
    extra = {k: [v] for k, v in kw.items()}
    with torch.inference_mode():
        return env.train.PrecisionTrainLoRA.execute(
            [model or env.with_lora], env.latent_list if latents is None else latents,
            [env.cond] if conds is None else conds, [steps], [0], ["err"],
            settings=[settings or env.Settings(checkpoint_every=1)], **extra)


CASES = [
    ("empty dataset", {"latents": []}, r"PrecisionTrainLoRA: input 'latents': the dataset is empty"),
    ("empty latent batch", {"latents": [{"samples": torch.zeros(0, 16, 1, 4, 4)}]},
     r"input 'latents': the dataset is empty"),
    ("count mismatch", {"latents": [{"samples": torch.randn(3, 16, 1, 4, 4)}], "conds": "two"},
     r"input 'conditioning': 2 conditioning rows for 3 latent samples"),
    ("wrong latent shape", {"latents": [{"samples": torch.randn(1, 16, 4, 4)}]},
     r"latent 0 has shape \(1, 16, 4, 4\) but this model \(cosmos_predict2\) expects \(B, C, T, H, W\) with C=16"),
    ("no lora", {"model": "base"}, r"PrecisionTrainLoRA: the model has no LoRA attached; put PrecisionAttachLoRA"),
    ("steps 0", {"steps": 0}, r"PrecisionTrainLoRA: input 'steps'=0 is below the minimum 1; use a value in \[1, 1000000\]"),
    ("bad name", {"name_override": "../x"}, r"input 'name'='../x' contains '\.\.'"),
    ("name with NUL", {"name_override": "a\x00b"}, r"input 'name'='a\\x00b' contains the control character"),  # D7
    ("name with newline", {"name_override": "a\nb"}, r"input 'name'='a\\nb' contains the control character"),  # D10
    ("overlong name", {"name_override": "n" * 300}, r"input 'name'='nnn.*\(300 characters\) has a part of 300 bytes"),  # D7
    ("resume outside", {"resume_from": "../../etc/passwd"}, r"input 'resume_from'='../../etc/passwd' contains '\.\.'"),
    ("resume NUL", {"resume_from": "x\x00.safetensors"}, r"input 'resume_from'='x\\x00.safetensors' contains the control"),  # D7
    ("resume missing", {"resume_from": "nope.safetensors"}, r"input 'resume_from'='nope.safetensors': no checkpoint state"),
]


@pytest.mark.parametrize("label, change, message", CASES, ids=[c[0] for c in CASES])
def test_train_node_rejects_bad_input_and_writes_nothing(env, label, change, message):
    env.latent_list = [env.latent]
    before = _listing()
    kwargs = {}
    change = dict(change)
    if change.get("model") == "base":
        change["model"] = env.model
    if change.get("conds") == "two":
        change["conds"] = [make_conditioning(env.model, 2)]
    if "resume_from" in change:
        kwargs["resume_from"] = change.pop("resume_from")
    name = change.pop("name_override", None)
    with pytest.raises(ValueError, match=message):
        if name is None:
            _train(env, **change, **kwargs)
        else:
            with torch.inference_mode():
                env.train.PrecisionTrainLoRA.execute([env.with_lora], [env.latent], [env.cond], [2], [0], [name])
    after = _listing()
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not changed, f"{label}: the rejected run wrote {changed}"


def test_flux_latent_into_cosmos_model_is_rejected(env):
    flux_latent = make_latent(tiny_flux1(), 1, width=32, height=32)
    env.latent_list = [flux_latent]
    with pytest.raises(ValueError, match=r"expects \(B, C, T, H, W\)"):
        _train(env)


SETTINGS_CASES = [
    ({"learning_rate": 0.0}, r"PrecisionTrainSettings: TrainSettings.learning_rate=0.0: must be > 0"),
    ({"learning_rate": -1e-4}, r"input 'learning_rate'=-0.0001 is below the minimum 0; use a value in \[0, 10\]"),
    ({"optimizer": "fromage"}, r"PrecisionTrainSettings: input 'optimizer'='fromage' is not an option; choose one of"),
    ({"optimizer": "adamw8bit"}, r"input 'optimizer'='adamw8bit' is unavailable: pip install bitsandbytes, or choose 'adamw'"),
    ({"optimizer": "adamw4bit_ao"}, r"input 'optimizer'='adamw4bit_ao' is unavailable: pip install torchao"),
    ({"optimizer": "schedulefree_adamw", "ema_decay": 0.99}, r"TrainSettings.ema_decay=0.99: an EMA on top of the "
     r"schedule-free optimizer 'schedulefree_adamw' is not offered"),
    # D5 (issue 13): NaN passed every range check; these reached the loop (clipping / DOP silently off)
    ({"max_grad_norm": float("nan")}, r"input 'max_grad_norm'=nan is not a finite number; use a value in \[0, 1000\]"),
    ({"dop_multiplier": float("nan")}, r"input 'dop_multiplier'=nan is not a finite number"),
    ({"weight_decay": float("nan")}, r"input 'weight_decay'=nan is not a finite number"),
    ({"logit_mean": float("nan")}, r"input 'logit_mean'=nan is not a finite number"),
    ({"warmup_steps": 10}, r"warmup_steps=10: has no effect with lr_schedule 'constant'"),
]


@pytest.mark.parametrize("change, message", SETTINGS_CASES)
def test_settings_node_rejects_bad_values(env, change, message):
    import importlib.util

    if "bitsandbytes" in message and importlib.util.find_spec("bitsandbytes"):
        pytest.skip("bitsandbytes is installed here, so adamw8bit is available")
    if "torchao" in message and importlib.util.find_spec("torchao"):
        pytest.skip("torchao is installed here, so adamw4bit_ao is available")
    kwargs = {**env.Settings().to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        env.train.PrecisionTrainSettings.execute(**kwargs)


def test_settings_node_defaults_are_the_dataclass_defaults(env):
    out = env.train.PrecisionTrainSettings.execute(**env.Settings().to_dict())
    assert out.result[0] == env.Settings()
    schema = env.train.PrecisionTrainSettings.define_schema()
    defaults = {i.id: i.default for i in schema.inputs}
    assert defaults == env.Settings().to_dict()


def test_conditioning_and_latents_of_another_model_are_named_not_a_shape_error(env):
    """D7 (issue 13): conditioning from another model failed in the forward with "mat1 and mat2 shapes
    cannot be multiplied"; a NaN latent trained on as if it were data."""
    env.latent_list = [env.latent]
    flux_cond = make_conditioning(tiny_flux1(), 1)
    with pytest.raises(ValueError, match=r"PrecisionTrainLoRA: input 'conditioning': item 0 has context shape \(1, 8, 64\) "
                                         r"but this model \(cosmos_predict2\) expects \(B, tokens, 1024\): it was encoded "
                                         r"for another model; connect conditioning from this model's text encoder"):
        _train(env, conds=[flux_cond])
    with pytest.raises(ValueError, match=r"input 'class_conditioning': item 0 has context shape \(1, 8, 64\)"):
        _train(env, class_conditioning=flux_cond)
    nan_latent = {"samples": torch.full_like(env.latent["samples"], float("nan"))}
    with pytest.raises(ValueError, match=r"input 'latents': latent 0 holds NaN/inf; encode the images again"):
        _train(env, latents=[nan_latent])


def test_an_exploding_run_fails_with_the_reason_and_says_so_in_its_done_event(env, one_thread):
    """D3 (issue 13): 67 of 80 steps skipped and 20 rollbacks with LoRA weights at 1.4e10 reported success,
    and the next node saved the LoRA as a good result."""
    import comfy_harness

    events = comfy_harness.server().events
    before = len(events)
    diverge = env.Settings(learning_rate=10.0, max_grad_norm=0.0, loraplus_ratio=100.0)
    with pytest.raises(ValueError, match=r"^\[Precision LoRA\] PrecisionTrainLoRA: the run failed \(failed: 12 steps, "
                                         r"\d+ skipped, \d+ rollbacks, largest \|LoRA weight\| .*\): the LoRA exploded: "
                                         r"its largest \|weight\| is .*, above the bound 1000 .* lower learning_rate"):
        _train(env, latents=[env.latent], steps=12, settings=diverge)
    done = [data for event, data, *_ in events[before:] if event == "precision_lora.train_done"]
    assert done and done[-1]["failed"] is True and done[-1]["outcome"].startswith("failed: 12 steps")


def test_a_healthy_run_records_its_outcome_in_the_lora_metadata(env, one_thread):
    out = _train(env, latents=[env.latent], steps=2, settings=env.Settings(learning_rate=1e-3))
    lora_set = env.glue.get_lora_set(out.result[0])
    assert lora_set.info["precision_lora_outcome"].startswith("ok: 2 steps, 0 skipped, 0 rollbacks")
