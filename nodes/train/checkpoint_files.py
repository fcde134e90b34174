"""Where training states live, and which state ``resume_from`` continues.

Checkpoints: ``models/loras/<run name>/<run name>_step<N>.safetensors`` with the training state
``<...>.trainstate`` beside it, so every LoRA loader (stock and the pack's) lists them, and only them:
``.trainstate`` is no model extension of ComfyUI (the ``.state.pt`` of earlier versions was).
``PrecisionSaveLoRA`` puts the state of the LoRA it saves beside that LoRA too (``training.checkpoint.state_beside``), in its
subfolder, so ``A/final`` and ``B/final`` keep separate states.

``resume_from`` takes a checkpoint as the LoRA lists name it (``<run>/<run>_step000010.safetensors``), its
absolute path inside a loras folder or the output folder (what the node shows), or a state's own name. The
state is looked for beside the LoRA in each loras folder, then in the output folder (Save LoRA's
``folder=output``), then in ``output/precision_lora/checkpoints`` where earlier versions put states (by the
same relative name, or by the LoRA's file name, which is how the earlier Save LoRA named them). At each place
a ``.trainstate`` is taken before an earlier version's ``.state.pt``. A state is only taken together with its
LoRA when that LoRA exists: ``check_pair`` refuses a state whose LoRA values are not the LoRA file's.
"""
from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass

from ...training.checkpoint import (LORA_SUFFIX, STATE_SUFFIXES, TrainingState, state_candidates,
                                   state_lora_mismatch, state_stem)
from ..checks.file_names import _absolute, inside, name_problem
from ..host.errors import plain

LEGACY_SUBDIR = ("precision_lora", "checkpoints")
NODE = "PrecisionTrainLoRA"
EXAMPLE = "'my_lora/my_lora_step000072.safetensors'"
HINT = (f"give a checkpoint as the LoRA lists name it, e.g. {EXAMPLE}, or its full path in a loras folder "
        "(as Train LoRA shows it), or leave resume_from empty")


def legacy_dir() -> str:
    import folder_paths

    return os.path.join(folder_paths.get_output_directory(), *LEGACY_SUBDIR)


def run_folder(name: str) -> str:
    """``<first loras folder>/<name>``: the folder of one run's checkpoints."""
    import folder_paths

    return os.path.join(os.path.abspath(folder_paths.get_folder_paths("loras")[0]), name)


def free_base(folder: str, stem: str) -> str:
    """``folder/stem`` (without suffix), or ``stem_1``, ``stem_2``... when a LoRA or state (either suffix) of that
    name exists."""
    base, n = os.path.join(folder, stem), 1
    while any(os.path.exists(base + suffix) for suffix in (LORA_SUFFIX, *STATE_SUFFIXES)):
        base, n = os.path.join(folder, f"{stem}_{n}"), n + 1
    return base


def checkpoint_base(name: str, step: int) -> str:
    return free_base(run_folder(name), f"{name}_step{step:06d}")


def _places() -> list[str]:
    """Folders that hold LoRAs with their states, in search order: the loras folders, then the output folder."""
    import folder_paths

    roots = [os.path.abspath(r) for r in folder_paths.get_folder_paths("loras")]
    return list(dict.fromkeys([*roots, os.path.abspath(folder_paths.get_output_directory())]))


@dataclass(frozen=True)
class ResumePick:
    """What ``resume_from`` names: the state file, the LoRA file it must match (None for a bare state with no
    LoRA beside it) and the name in the form the LoRA lists show."""

    state: str
    lora: str | None
    name: str


def _err(value: str, problem: str) -> ValueError:
    """``problem`` starts with its separator (" is ...", ": ...")."""
    return ValueError(f"{NODE}: input 'resume_from'={value!r}{problem}")


def relative_name(value: str) -> str:
    """``value`` as a name relative to its folder: an absolute path inside a loras folder, the output folder
    or the old checkpoint folder becomes its relative path; any other absolute path is refused with the hint."""
    norm = value.replace("\\", "/").strip()
    if not _absolute(norm):
        reason = name_problem(norm, subfolders=True)
        if reason:
            raise _err(value, f" {reason.split('; give a name')[0]}; {HINT}")
        return norm
    real = os.path.realpath(norm)
    for root in [legacy_dir(), *_places()]:  # the most specific folder first
        if inside(root, real) and os.path.realpath(root) != real:
            return os.path.relpath(real, os.path.realpath(root)).replace(os.sep, "/")
    raise _err(value, f" is an absolute path outside the loras folders and the output folder ({', '.join(_places())}); "
                      f"{HINT}")


def _lora_beside(state: str) -> str | None:
    for suffix in STATE_SUFFIXES:
        if state.endswith(suffix):
            lora = state[: -len(suffix)] + LORA_SUFFIX
            return lora if os.path.isfile(lora) else None
    return None


def _find_lora(rel: str) -> str | None:
    """The LoRA file ``rel`` names in the loras folders or the output folder, or None."""
    stem = state_stem(rel)
    lora = rel if rel.endswith(LORA_SUFFIX) else (rel if stem is None else stem) + LORA_SUFFIX
    for root in _places():
        path = os.path.join(root, lora)
        if inside(root, path) and os.path.isfile(path):
            return os.path.realpath(path)
    return None


def _search(value: str, rel: str) -> ResumePick | None:
    rels = state_candidates(rel)
    for root in _places():
        for cand in rels:
            path = os.path.join(root, cand)
            if not inside(root, path):
                raise _err(value, f" leaves {root}; {HINT}")
            if os.path.isfile(path):
                return ResumePick(os.path.realpath(path), _lora_beside(path), rel)
    legacy = legacy_dir()
    for cand in rels:  # where earlier versions (and the earlier Save LoRA) put states
        path = os.path.join(legacy, cand)
        if inside(legacy, path) and os.path.isfile(path):
            return ResumePick(os.path.realpath(path), _lora_beside(path) or _find_lora(rel), rel)
    lora = _find_lora(rel)
    if lora is not None and "/" in rel:  # the earlier Save LoRA named the state by the LoRA's file name only
        for cand in state_candidates(os.path.basename(rel)):
            path = os.path.join(legacy, cand)
            if os.path.isfile(path):
                return ResumePick(os.path.realpath(path), lora, rel)
    return None


def resolve_resume(value: str) -> ResumePick:
    """The state (and its LoRA) ``resume_from`` names; ValueError naming the places looked in, the right form
    and the nearest resumable checkpoints when there is none."""
    rel = relative_name(value)
    pick = _search(value, rel)
    if pick is not None:
        return pick
    folder = os.path.dirname(rel)
    missing = folder and not any(os.path.isdir(os.path.join(root, folder)) for root in _places())
    where = (f"there is no folder {folder!r} in {', '.join(_places())}" if missing else
             f"no checkpoint state {' or '.join(os.path.basename(p) for p in state_candidates(rel))} in "
             f"{', '.join(_places() + [legacy_dir()])}")
    near = nearest_checkpoints(rel)
    listed = f" (resumable checkpoints: {', '.join(near)})" if near else ""
    raise _err(value, f": {where}{listed}; {HINT}")


def resumable_checkpoints() -> list[str]:
    """LoRAs in the loras lists that have a training state beside them (names as the lists show them)."""
    import folder_paths

    out = []
    for name in folder_paths.get_filename_list("loras"):
        path = folder_paths.get_full_path("loras", name)
        if name.endswith(LORA_SUFFIX) and path and any(os.path.isfile(p) for p in state_candidates(path)):
            out.append(name.replace("\\", "/"))
    return out


def nearest_checkpoints(rel: str, n: int = 3) -> list[str]:
    names = resumable_checkpoints()
    return difflib.get_close_matches(rel, names, n=n, cutoff=0.3) or names[-n:]


def check_pair(value: str, pick: ResumePick, state: TrainingState) -> None:
    """Refuse a state whose LoRA values are not its LoRA file's (another run's state, a LoRA replaced after
    the state was written), naming both files."""
    if pick.lora is None:
        return
    from ...lora.file import read_lora_file

    try:
        tensors, _ = read_lora_file(pick.lora)
    except (ValueError, FileNotFoundError) as exc:
        raise _err(value, f": cannot check the training state {pick.state} against its LoRA: "
                          f"{plain(str(exc))}") from None
    reason = state_lora_mismatch(state, tensors)
    if reason:
        raise _err(value, f": the training state {pick.state} does not belong to the LoRA {pick.lora} ({reason}): "
                          "it was written by another run or the LoRA was replaced since; resume from the "
                          "checkpoint the state was saved with, or leave resume_from empty to start a new run")


def _stat(path: str | None) -> tuple[int, int] | None:
    if path is None:
        return None
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=8)
def _pair_problem(value: str, pick: ResumePick, stats: tuple) -> str | None:
    """``check_pair``'s verdict, kept per file versions (``stats``): validation and the run that follows read
    the state once for it."""
    from ...training.checkpoint import load_state

    try:
        check_pair(value, pick, load_state(pick.state))
    except ValueError as exc:
        return str(exc)
    return None


def verify_resume(value: str) -> ResumePick:
    """``resolve_resume`` plus ``check_pair`` (the state read once per file version): what validation checks,
    before anything runs. ValueError with the message otherwise."""
    pick = resolve_resume(value)
    problem = _pair_problem(value, pick, (_stat(pick.state), _stat(pick.lora)))
    if problem:
        raise ValueError(problem)
    return pick
