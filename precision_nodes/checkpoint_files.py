"""Where training checkpoints live: ``models/loras/<run name>/<run name>_step<N>.safetensors`` with the
training state ``<...>.state.pt`` beside it, so every LoRA loader (stock and the pack's) lists them.

``resume_from`` takes the name a LoRA loader shows (``<run>/<run>_step000010.safetensors``) or a plain file
name; the state is looked for beside the LoRA in each loras folder, then in ``output/precision_lora/checkpoints``
where earlier versions of the pack (and PrecisionSaveLoRA) put states, so existing runs still resume.
"""
from __future__ import annotations

import os

from ..training.checkpoint import LORA_SUFFIX, STATE_SUFFIX, state_path_for
from .file_names import inside, name_problem

LEGACY_SUBDIR = ("precision_lora", "checkpoints")
NODE = "PrecisionTrainLoRA"


def legacy_dir() -> str:
    import folder_paths

    return os.path.join(folder_paths.get_output_directory(), *LEGACY_SUBDIR)


def run_folder(name: str) -> str:
    """``<first loras folder>/<name>``: the folder of one run's checkpoints."""
    import folder_paths

    return os.path.join(os.path.abspath(folder_paths.get_folder_paths("loras")[0]), name)


def free_base(folder: str, stem: str) -> str:
    """``folder/stem`` (without suffix), or ``stem_1``, ``stem_2``... when a LoRA or state of that name exists."""
    base, n = os.path.join(folder, stem), 1
    while os.path.exists(base + LORA_SUFFIX) or os.path.exists(base + STATE_SUFFIX):
        base, n = os.path.join(folder, f"{stem}_{n}"), n + 1
    return base


def checkpoint_base(name: str, step: int) -> str:
    return free_base(run_folder(name), f"{name}_step{step:06d}")


def resume_candidates(value: str) -> list[tuple[str, str]]:
    """(root, state path) pairs to try for ``resume_from``, in order."""
    import folder_paths

    rel = state_path_for(value.replace("\\", "/").strip())
    legacy = legacy_dir()
    pairs = [(os.path.abspath(root), os.path.join(root, rel)) for root in folder_paths.get_folder_paths("loras")]
    pairs.append((legacy, os.path.join(legacy, rel)))
    pairs.append((legacy, os.path.join(legacy, os.path.basename(rel))))
    return pairs


def resolve_resume(value: str) -> str:
    """Path of the training state for ``resume_from``; ValueError naming the places looked in when none."""
    reason = name_problem(value, subfolders=True)
    if reason:
        raise ValueError(f"[Precision LoRA] {NODE}: input 'resume_from'={value!r} {reason}")
    looked = []
    for root, path in resume_candidates(value):
        if not inside(root, path):
            raise ValueError(f"[Precision LoRA] {NODE}: input 'resume_from'={value!r} leaves {root}")
        if os.path.isfile(path):
            return os.path.realpath(path)
        looked.append(os.path.dirname(path))
    raise ValueError(f"[Precision LoRA] {NODE}: input 'resume_from'={value!r}: no checkpoint state "
                     f"{os.path.basename(state_path_for(value))} in {', '.join(dict.fromkeys(looked))}; pick a checkpoint "
                     "as the LoRA loaders list it (e.g. 'my_run/my_run_step000100.safetensors') or leave it empty")
