"""LoRA nodes: PrecisionAttachLoRA, PrecisionSaveLoRA, PrecisionLoadLoRA (thin: config → one glue call)."""
from __future__ import annotations

import logging
import os

import folder_paths
import torch

from ...attention.backends import BACKENDS
from ...attention.config import SCALE_MODES, AttentionConfig
from ...training.checkpoint import save_state, state_beside
from ...training.guard import NonFiniteError
from ...lora.config import ADAPTER_KINDS, MAX_LOKR_FACTOR, MAX_RANK, PARAM_DTYPES, LoRAConfig
from ...lora.file import KEY_STYLES, SAVE_DTYPES, default_key_style, read_lora_file
from ...lora.targets import preset_names
from . import glue
from .trained_over import missing_adapters, missing_note
from ..checks.gate import PrecisionNode
from ..host.types import TrainingStateType
from ..host import page
from ..host.errors import plain
from ..host.comfy_io import io

log = logging.getLogger(__name__)

DEFAULTS = LoRAConfig()
ATTENTION_DEFAULTS = AttentionConfig()
NONE = "none"


def _loras() -> list[str]:
    return folder_paths.get_filename_list("loras")


def _err(node: str, message: str) -> ValueError:
    return ValueError(f"{node}: {message}")


def _float(name: str, default: float, lo: float, hi: float, step: float, tip: str) -> io.Float.Input:
    return io.Float.Input(name, default=default, min=lo, max=hi, step=step, tooltip=tip)


class PrecisionAttachLoRA(PrecisionNode):
    NODE = "PrecisionAttachLoRA"
    FILE_LIST_INPUTS = {"init_lora": "models/loras"}

    @classmethod
    def define_schema(cls) -> io.Schema:
        drop = "Probability in [0, 0.99]; active only while training."
        return io.Schema(
            node_id=cls.NODE, display_name="Attach LoRA (Precision)", category="precision_lora/lora",
            description="Adds trainable LoRA layers to a copy of the model. The LoRA path runs in fp32 and is added "
                        "before the base output is rounded, so small updates survive bf16. Bypass the node to remove it.",
            inputs=[
                io.Model.Input("model", tooltip="Diffusion model to adapt (it is cloned, never changed)."),
                io.Int.Input("rank", default=DEFAULTS.rank, min=1, max=MAX_RANK, step=1, tooltip="LoRA rank (dim)."),
                _float("alpha", DEFAULTS.alpha, 0.01, 4096.0, 0.01, "LoRA alpha; scale = alpha / rank (alpha / sqrt(rank) with rsLoRA)."),
                io.Combo.Input("targets", options=preset_names(), default=DEFAULTS.targets,
                               tooltip="Preset of layers per model family: attention, attention_mlp, all, none (include only)."),
                io.String.Input("include", default=DEFAULTS.include, tooltip="Extra layers: regex searched in module paths, e.g. 'img_mlp'."),
                io.String.Input("exclude", default=DEFAULTS.exclude, tooltip="Regex of module paths to leave out, e.g. 'txt_'."),
                io.String.Input("blocks", default=DEFAULTS.blocks, tooltip="Block filter: '0-3,7' or 'double_blocks:0-5, single_blocks:0-9'; empty = all."),
                io.Boolean.Input("fp32_accumulation", default=DEFAULTS.fp32_accumulation,
                                 tooltip="Sum base + LoRA in fp32 before the one cast to the model dtype (recommended)."),
                _float("dropout", DEFAULTS.dropout, 0.0, 0.99, 0.01, "Input dropout of the LoRA path. " + drop),
                _float("rank_dropout", DEFAULTS.rank_dropout, 0.0, 0.99, 0.01, "Drops whole ranks per sample. " + drop),
                _float("module_dropout", DEFAULTS.module_dropout, 0.0, 0.99, 0.01, "Skips a whole LoRA layer. " + drop),
                io.Boolean.Input("rslora", default=DEFAULTS.rslora, tooltip="rsLoRA scale alpha / sqrt(rank)."),
                io.Combo.Input("param_dtype", options=list(PARAM_DTYPES), default=DEFAULTS.param_dtype,
                               tooltip="Storage of the LoRA weights; fp32 recommended (bf16 needs stochastic rounding in the optimizer)."),
                io.Int.Input("seed", default=DEFAULTS.seed, min=0, max=2**63 - 1, step=1, tooltip="Seed of the LoRA init and dropouts."),
                io.Combo.Input("init_lora", options=[NONE, *_loras()], default=NONE,
                               tooltip="Continue training from this LoRA file (same rank and targets)."),
                io.Boolean.Input("dry_run", default=False, tooltip="Only list the matched layers; return the model unchanged."),
                io.Combo.Input("adapter", options=list(ADAPTER_KINDS), default=DEFAULTS.adapter, optional=True,
                               tooltip="lora: low-rank pair. lokr: Kronecker product (few parameters; lokr_factor). loha: "
                                       "Hadamard product of two low-rank pairs (rank up to rank^2). dora: LoRA plus a "
                                       "per-column magnitude. locon: LoRA on the Linear layers plus the res-block Conv2d layers of a UNet "
                                       "(SD1.x / SDXL; docs/lora.md). All keep the fp32 accumulation and save in stock ComfyUI keys."),
                io.Int.Input("lokr_factor", default=DEFAULTS.lokr_factor, min=-1, max=MAX_LOKR_FACTOR, step=1, optional=True,
                             tooltip="LoKr only: the small Kronecker factor's side (a divisor of the layer's width at most "
                                     "this); -1 = as square as possible. 0 is invalid."),
            ],
            outputs=[io.Model.Output(display_name="model", tooltip="The model with LoRA layers attached."),
                     io.String.Output(display_name="targets", tooltip="The adapted layers with their shapes.")],
        )

    @classmethod
    def check(cls, values: dict) -> str | None:
        """Regexes, block filter and preset name need no model: checked here, before anything runs."""
        names = ("targets", "include", "exclude", "blocks", "param_dtype")
        if any(values.get(n) is None for n in names):
            return None  # a linked input: checked again when the node runs
        given = {n: values[n] for n in ("adapter", "lokr_factor", "dropout", "rank_dropout") if values.get(n) is not None}
        try:
            LoRAConfig(**{n: values[n] for n in names}, **given)  # validates
        except ValueError as e:
            return plain(str(e))
        return None

    @classmethod
    def execute(cls, model, rank, alpha, targets, include, exclude, blocks, fp32_accumulation, dropout, rank_dropout,
                module_dropout, rslora, param_dtype, seed, init_lora, dry_run, adapter=DEFAULTS.adapter,
                lokr_factor=DEFAULTS.lokr_factor) -> io.NodeOutput:
        try:
            cfg = LoRAConfig(rank=rank, alpha=alpha, rslora=rslora, dropout=dropout, rank_dropout=rank_dropout,
                             module_dropout=module_dropout, fp32_accumulation=fp32_accumulation, targets=targets,
                             include=include, exclude=exclude, blocks=blocks, seed=seed, param_dtype=param_dtype,
                             adapter=adapter, lokr_factor=lokr_factor)
            target_plan = glue.target_plan(model, cfg)
        except ValueError as e:
            raise _err(cls.NODE, plain(str(e))) from None
        plan = target_plan.chosen
        listing = "\n".join([f"{p}  ({i} -> {o})" for p, (i, o, *_k) in plan.items()] + target_plan.report_lines())
        if dry_run:
            return io.NodeOutput(model, f"dry run: {len(plan)} layers\n{listing}")
        init = None if init_lora == NONE else folder_paths.get_full_path_or_raise("loras", init_lora)
        patched = glue.attach_lora(model, cfg, init_file=init, plan=plan)
        n_params = glue.get_lora_set(patched).num_parameters()
        return io.NodeOutput(patched, f"{len(plan)} layers, {n_params:,} parameters\n{listing}")


class PrecisionSaveLoRA(PrecisionNode):
    NODE = "PrecisionSaveLoRA"
    FILE_NAME_INPUTS = {"filename_prefix": (True, False)}

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=cls.NODE, display_name="Save LoRA (Precision)", category="precision_lora/lora",
            description="Writes the LoRA attached to the model as safetensors (kohya keys for Flux, diffusion_model "
                        "keys otherwise, explicit alpha) with metadata incl. the attention settings. Atomic; never overwrites by default.",
            inputs=[
                io.Model.Input("model", tooltip="A model that carries a LoRA from Attach LoRA / Train LoRA."),
                io.String.Input("filename_prefix", default="precision_lora/lora",
                                tooltip="Name (may include subfolders) relative to the target folder."),
                io.Combo.Input("folder", options=list(glue.SAVE_FOLDERS), default="loras",
                               tooltip="models/loras (first loras folder; Load LoRA lists it) or the output folder."),
                io.Combo.Input("save_dtype", options=list(SAVE_DTYPES), default="fp32",
                               tooltip="dtype of the saved factors (fp32 keeps every bit of the trained weights)."),
                io.Combo.Input("key_style", options=["auto", *KEY_STYLES], default="auto",
                               tooltip="auto: kohya 'lora_unet_' for the Flux family, 'diffusion_model.' for others."),
                io.Boolean.Input("use_counter", default=True, tooltip="Append ComfyUI's _00001_ counter to the name."),
                io.Boolean.Input("overwrite", default=False, tooltip="Replace an existing file of the same name."),
                TrainingStateType.Input("training_state", optional=True,
                                        tooltip="From the PrecisionTrainLoRA that produced the model: also writes "
                                                "<name>.trainstate (optimizer, RNG, step, loss history) beside the "
                                                "LoRA, so PrecisionTrainLoRA's resume_from=<subfolder>/<name>.safetensors "
                                                "continues this run exactly."),
            ],
            outputs=[io.String.Output(display_name="path", tooltip="Absolute path of the written LoRA file.")],
            is_output_node=True, not_idempotent=True,
        )

    @classmethod
    def execute(cls, model, filename_prefix, folder, save_dtype, key_style, use_counter, overwrite,
                training_state=None) -> io.NodeOutput:
        lora_set = glue.get_lora_set(model)
        if lora_set is None:
            raise _err(cls.NODE, "input 'model' carries no LoRA: connect the output of Attach LoRA or Train LoRA")
        if training_state is not None:
            reason = _state_mismatch(lora_set, training_state)
            if reason:
                raise _err(cls.NODE, f"input 'training_state' {reason}: connect the training_state output of the "
                                     "PrecisionTrainLoRA whose model you save")
        info = glue.describe_model(model)
        style = default_key_style(info.family) if key_style == "auto" else key_style
        made = glue.folders_made_for(folder, filename_prefix)
        try:
            return cls._save(model, lora_set, info, style, folder, filename_prefix, save_dtype, use_counter, overwrite,
                             training_state)
        except BaseException:
            glue.remove_empty(made)  # a failed save leaves nothing behind, not even the folders made for it
            raise

    @classmethod
    def _save(cls, model, lora_set, info, style: str, folder: str, filename_prefix: str, save_dtype: str,
              use_counter: bool, overwrite: bool, training_state) -> io.NodeOutput:
        path = glue.resolve_save_path(folder, filename_prefix, use_counter)
        state_path = None if training_state is None else state_beside(path)
        extra = {"ss_key_style": style, "ss_save_dtype": save_dtype}
        if state_path is not None:
            extra["precision_lora_training_state"] = os.path.basename(state_path)
        for target in (path, state_path):  # both checked before either is written
            if target is not None and os.path.exists(target) and not overwrite:
                raise _err(cls.NODE, f"{os.path.basename(target)} exists in {os.path.dirname(target)}: enable "
                                     "overwrite or use_counter, or change filename_prefix")
        path = _write(cls.NODE, path, model, info, lora_set, style, save_dtype, extra)
        if state_path is not None:
            try:
                save_state(state_path, training_state)
            except BaseException as e:
                os.remove(path)  # a LoRA whose training state could not be written would be a half-written save
                if isinstance(e, NonFiniteError):
                    raise _err(cls.NODE, f"input 'training_state' holds NaN/inf; nothing was written ({e})") from e
                raise
        shown = [path] if state_path is None else [path, state_path]
        page.show_on_node("saved " + "\nand ".join(shown))
        # "precision_lora_saved": web/lora_refresh.js refreshes the LoRA lists of every loader when it sees it
        return io.NodeOutput(path, ui={"text": shown, "precision_lora_saved": [path]})


def _write(node: str, path: str, model, info, lora_set, style: str, save_dtype: str, extra: dict) -> str:
    """``glue.write_lora`` (the one LoRA writer), its refusals said as this node's: a value that does not fit
    ``save_dtype`` (fp16 overflow used to be written as inf and loaded silently: tests/unit/test_lora_file.py) or
    NaN/inf in the LoRA; nothing is written then."""
    try:
        return glue.write_lora(path, model, info, lora_set, style, save_dtype, extra, overwrite=True)
    except NonFiniteError as e:
        raise _err(node, f"input 'model' carries a LoRA with NaN/inf values ({plain(str(e))}); "
                         "nothing was written: retrain with a lower learning_rate or max_grad_norm > 0") from None
    except ValueError as e:
        raise _err(node, f"input 'save_dtype'={save_dtype!r}: {plain(str(e))}") from None


def _state_mismatch(lora_set, state) -> str | None:
    """Why ``state`` is not the training state of ``lora_set`` (names, shapes, values), or None."""
    params = dict(lora_set.named_parameters())
    lora = getattr(state, "lora", None)
    if not isinstance(lora, dict) or set(lora) != set(params):
        return "belongs to a different LoRA (its parameters are not this LoRA's)"
    for name, p in params.items():
        saved = lora[name]
        if tuple(saved.shape) != tuple(p.shape) or not torch.equal(p.detach().cpu().to(saved.dtype), saved):
            return f"does not hold this LoRA's values ('{name}' differs)"
    return None


class PrecisionLoadLoRA(PrecisionNode):
    NODE = "PrecisionLoadLoRA"
    FILE_LIST_INPUTS = {"lora_name": "models/loras"}

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=cls.NODE, display_name="Load LoRA (Precision)", category="precision_lora/lora",
            description="Applies a LoRA and the attention settings (softmax scale, backend) recorded in it. fp32 mode "
                        "keeps the LoRA unmerged on the fp32 path; merge uses ComfyUI's standard weight patching.",
            inputs=[
                io.Model.Input("model", tooltip="Diffusion model (cloned, never changed)."),
                io.Combo.Input("lora_name", options=_loras(), tooltip="LoRA file in models/loras."),
                _float("strength", 1.0, -10.0, 10.0, 0.01, "LoRA strength (1.0 = as trained)."),
                io.Combo.Input("mode", options=list(glue.LOAD_MODES), default="fp32",
                               tooltip="fp32: unmerged, sum before rounding (exact as trained). merge: ComfyUI's weight merge."),
                io.Combo.Input("attention", options=list(glue.ATTENTION_POLICIES), default="apply_recorded",
                               tooltip="apply_recorded: use the scale/backend saved in the file; ignore: leave the model's; "
                                       "override: use the three override inputs below."),
                io.Combo.Input("override_backend", options=["auto", *BACKENDS], default=ATTENTION_DEFAULTS.backend,
                               tooltip="Backend when attention = override."),
                io.Combo.Input("override_scale_mode", options=list(SCALE_MODES), default=ATTENTION_DEFAULTS.scale_mode,
                               tooltip="Scale mode when attention = override: default 1/sqrt(d), absolute, multiplier of 1/sqrt(d)."),
                _float("override_scale_value", ATTENTION_DEFAULTS.scale_value, 0.0001, 100.0, 0.0001, "Scale value when attention = override."),
            ],
            outputs=[io.Model.Output(display_name="model", tooltip="The model with the LoRA (and attention settings)."),
                     io.String.Output(display_name="info", tooltip="What was applied.")],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
        )

    @classmethod
    def fingerprint_inputs(cls, lora_name=None, **_: object) -> object:
        """Re-run when the file changes on disk (e.g. retrained to the same name), not only when inputs do."""
        path = folder_paths.get_full_path("loras", lora_name) if lora_name else None
        if path is None or not os.path.isfile(path):
            return lora_name
        st = os.stat(path)
        return (path, st.st_mtime_ns, st.st_size)

    @classmethod
    def execute(cls, model, lora_name, strength, mode, attention, override_backend, override_scale_mode,
                override_scale_value) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise("loras", lora_name)
        name = f"lora_name {lora_name!r}"
        try:
            tensors, md = read_lora_file(path)
        except (ValueError, FileNotFoundError) as e:
            raise _err(cls.NODE, f"input 'lora_name'={lora_name!r}: {plain(str(e))}") from None
        try:
            override = AttentionConfig(backend=override_backend, scale_mode=override_scale_mode,
                                       scale_value=override_scale_value) if attention == "override" else None
            patched = glue.load_lora(model, tensors, strength, mode, name)
            patched, note = glue.apply_attention_policy(patched, md, attention, override, name)
        except (ValueError, FileNotFoundError) as e:
            raise _err(cls.NODE, plain(str(e))) from None
        info = f"{lora_name}: {mode}, strength {strength}; {note}"
        hidden = getattr(cls, "hidden", None)
        missing = missing_adapters(md, getattr(hidden, "prompt", None), getattr(hidden, "unique_id", None))
        if missing:
            info += "\n" + missing_note(lora_name, missing)
            log.warning("%s: %s", cls.NODE, missing_note(lora_name, missing))
        return io.NodeOutput(patched, info)


NODES = [PrecisionAttachLoRA, PrecisionSaveLoRA, PrecisionLoadLoRA]
