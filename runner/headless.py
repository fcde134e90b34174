"""Headless runner: the training part of an API-format workflow, executed by ComfyUI's own executor in this
process (no server, no browser), on one process or as one rank of a ``torchrun`` data-parallel run.

ComfyUI must already be imported with its nodes and this pack loaded (``scripts/train.py`` does that).
The graph's own nodes do the work: loaders, dataset nodes, attention patch, LoRA attach, settings, train,
save. So a run writes the same LoRA, checkpoints and training state as the same graph queued in the UI.

The training part: every ``PrecisionTrainLoRA`` node, and the pack's file-writing nodes fed by one
(``PrecisionSaveLoRA``, ``PrecisionLossGraph``), with whatever they need upstream; sampling and preview
branches are left out. Under ``torchrun`` every rank runs the train nodes (their loop shards each global
batch, see ``training.distributed``) and only rank 0 runs the writers, writes checkpoints and prints.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import filecmp
import json
import os
import shutil
import signal
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..nodes.checks.gate_errors import collapse
from ..training import distributed
from ..training.checkpoint import (LEGACY_STATE_SUFFIX, LORA_SUFFIX, STATE_SUFFIX, STATE_SUFFIXES, find_state,
                                   state_candidates, state_stem)

TRAIN_NODE = "PrecisionTrainLoRA"
WRITER_NODES = ("PrecisionSaveLoRA", "PrecisionLossGraph")
PROG = "scripts/train.py"


class WorkflowError(ValueError):
    """The workflow file or the command line cannot be run; the message says what to change."""


# ---- the workflow file ----

def load_workflow(path: str) -> dict:
    """The API-format prompt in ``path``. WorkflowError for a missing file, bad JSON or the UI format."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise WorkflowError(f"{PROG}: workflow {path!r} not found; give the path of a workflow saved with "
                            "ComfyUI's 'Export (API)'") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WorkflowError(f"{PROG}: workflow {path!r} is not JSON ({exc})") from None
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        raise WorkflowError(f"{PROG}: {path!r} is a workflow in the UI format; in ComfyUI use Workflow > "
                            "Export (API) and run that file")
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict):
        data = data["prompt"]  # the body of a /prompt request
    if not isinstance(data, dict) or not data or not all(
            isinstance(n, dict) and isinstance(n.get("class_type"), str) for n in data.values()):
        raise WorkflowError(f"{PROG}: {path!r} is not an API-format workflow (an object of nodes, each with "
                            "'class_type' and 'inputs'); export it with ComfyUI's 'Export (API)'")
    return data


def _links(node: dict) -> list[str]:
    return [str(v[0]) for v in node.get("inputs", {}).values()
            if isinstance(v, list) and len(v) == 2 and isinstance(v[0], (str, int))]


def _ancestors(prompt: dict, node_id: str) -> set[str]:
    seen, todo = set(), [node_id]
    while todo:
        for dep in _links(prompt.get(todo.pop(), {})):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def train_nodes(prompt: dict) -> list[str]:
    return sorted((i for i, n in prompt.items() if n["class_type"] == TRAIN_NODE), key=_order)


def _order(node_id: str) -> tuple:
    return (0, int(node_id), "") if node_id.isdigit() else (1, 0, node_id)


def training_targets(prompt: dict, writers: bool = True) -> list[str]:
    """The nodes to execute: every train node and (``writers``) every writer fed by one."""
    trains = set(train_nodes(prompt))
    if not trains:
        raise WorkflowError(f"{PROG}: the workflow has no {TRAIN_NODE} node, so there is nothing to train; "
                            "run a training workflow (e.g. workflows/api/train_lora.json)")
    out = set(trains)
    if writers:
        out |= {i for i, n in prompt.items() if n["class_type"] in WRITER_NODES and _ancestors(prompt, i) & trains}
    return sorted(out, key=_order)


def with_overrides(prompt: dict, steps: int | None = None, resume_name: str | None = None) -> dict:
    """A copy of ``prompt`` with every train node's ``steps`` set to ``steps`` and the first train node of
    the chain (the one not fed a training_state) resuming from ``resume_name`` (a checkpoint name)."""
    prompt = copy.deepcopy(prompt)
    trains = train_nodes(prompt)
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise WorkflowError(f"{PROG}: --steps {steps!r}: must be an integer > 0")
        for i in trains:
            prompt[i]["inputs"]["steps"] = steps
    if resume_name:
        roots = [i for i in trains if not isinstance(prompt[i]["inputs"].get("training_state"), list)]
        if len(roots) != 1:
            raise WorkflowError(f"{PROG}: --resume needs exactly one {TRAIN_NODE} that starts a run (not fed a "
                                f"training_state); this workflow has {len(roots)} ({', '.join(roots)}); set "
                                "resume_from on the node you mean in the workflow instead")
        if isinstance(prompt[roots[0]]["inputs"].get("resume_from"), list):
            raise WorkflowError(f"{PROG}: --resume: input 'resume_from' of node {roots[0]} is linked to another "
                                "node; unlink it or leave out --resume")
        prompt[roots[0]]["inputs"]["resume_from"] = resume_name
    return prompt


def stage_resume(path: str, checkpoint_folder: str) -> str:
    """The name ``PrecisionTrainLoRA``'s ``resume_from`` takes for the training state ``path``: a state or
    checkpoint LoRA file, or a name the node resolves itself (what its ``resume_from`` accepts). A LoRA file's
    state is its ``.trainstate``, else the ``.state.pt`` of earlier versions. A file outside
    ``checkpoint_folder`` (a folder the node searches) is copied into it first, with its LoRA file, under a
    free name and the current state suffix, so the node reads it the way it reads the UI's own checkpoints."""
    found = find_state(path)
    if not os.path.isabs(path) and found is None:
        return path  # not a file here: a name the node resolves itself (a checkpoint a LoRA loader lists)
    if found is None:
        looked = " or ".join(os.path.abspath(p) for p in state_candidates(path))
        raise WorkflowError(f"{PROG}: --resume {path!r}: no training state file {looked}; give a '*{STATE_SUFFIX}' "
                            f"file (or '*{LEGACY_STATE_SUFFIX}' of earlier versions, or its checkpoint '*{LORA_SUFFIX}') "
                            "written by a training run")
    state = os.path.abspath(found)
    folder = os.path.realpath(checkpoint_folder)
    if os.path.dirname(os.path.realpath(state)) == folder:
        return os.path.basename(state)
    os.makedirs(folder, exist_ok=True)
    stem = os.path.basename(state_stem(state))
    name, n = stem, 1
    while any(os.path.exists(os.path.join(folder, name + s)) for s in (LORA_SUFFIX, *STATE_SUFFIXES)):
        for suffix in STATE_SUFFIXES:
            there = os.path.join(folder, name + suffix)
            if os.path.isfile(there) and filecmp.cmp(there, state, shallow=False):
                return name + suffix  # the same file is already there
        name, n = f"{stem}_{n}", n + 1
    lora = state_stem(state) + LORA_SUFFIX
    if os.path.isfile(lora):
        shutil.copyfile(lora, os.path.join(folder, name + LORA_SUFFIX))
    shutil.copyfile(state, os.path.join(folder, name + STATE_SUFFIX))
    return name + STATE_SUFFIX


# ---- progress on the console ----

class Progress:
    """The console of a headless run. Progress is the train node's own line (step, smoothed loss, lr, it/s and
    ETA, every twentieth of its steps or 30 s: ``nodes.train.node.ConsoleLine``): the node hands it to the
    stand-in server instead of ComfyUI's log, so each report is printed once, by ``echo``. A train node's end
    (outcome, checkpoint) gets a line of its own."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo

    def line(self, text: str) -> None:
        self.echo(text)

    def event(self, name: str, data: Any) -> None:
        if name == "precision_lora.train_done" and isinstance(data, dict):
            how = "stopped" if data.get("stopped") else "done"
            extra = f", checkpoint {data['checkpoint']}" if data.get("checkpoint") else ""
            self.echo(f"[train {data.get('node')}] {how} at step {data.get('steps')}: {data.get('outcome')}{extra}")


class ProgressServer:
    """The stand-in for ComfyUI's PromptServer while the runner executes: what the executor and the nodes
    send goes to ``Progress`` (rank 0) instead of a browser."""

    def __init__(self, progress: Progress | None) -> None:
        from aiohttp import web

        self.progress = progress
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.routes = web.RouteTableDef()
        self.supports: set = set()

    def send_sync(self, event, data, sid=None) -> None:
        if self.progress is not None:
            self.progress.event(event, data)

    def send_progress_text(self, text, node_id, sid=None) -> None:
        pass

    def precision_lora_console(self, line: str) -> None:
        """The train node's progress line (rank 0 prints it; the other ranks stay quiet)."""
        if self.progress is not None:
            self.progress.line(line)


# ---- the run ----

@dataclass
class RunResult:
    success: bool
    error: str | None = None
    written: list[str] = field(default_factory=list)  # files this run created under the output folder


def _output_files(roots: list[str]) -> set[str]:
    found = set()
    for root in roots:
        for dirpath, _, files in os.walk(root):
            found.update(os.path.join(dirpath, f) for f in files)
    return found


def _error_text(messages: list) -> str:
    for event, data in messages:
        if event == "execution_error":
            return (f"node {data.get('node_id')} ({data.get('node_type')}) failed: "
                    f"{data.get('exception_type', 'error')}: {data.get('exception_message', '').strip()}")
        if event == "execution_interrupted":
            return f"interrupted at node {data.get('node_id')} ({data.get('node_type')})"
    return "the prompt did not finish (no error message from ComfyUI)"


def run(prompt: dict, steps: int | None = None, resume: str | None = None,
        echo: Callable[[str], None] | None = None) -> RunResult:
    """Execute the training part of ``prompt`` (see the module docstring). ``steps`` overrides every train
    node's steps; ``resume`` (a training state file, or a checkpoint name) feeds the first train node.
    Under ``torchrun`` this process joins the data-parallel run for the duration of the call. Progress
    lines (the train node's, see ``Progress``) go to ``echo`` (default: print), on rank 0 only."""
    import execution
    import folder_paths
    import server as comfy_server
    import comfy.model_management as mm

    from ..nodes.train.glue import checkpoint_dir

    echo = echo or (lambda line: print(line, flush=True))
    parallel = distributed.activate(mm.get_torch_device()) if distributed.launched_by_torchrun() else None
    main = parallel is None or parallel.is_main
    say = echo if main else (lambda line: None)
    try:
        resume_name = stage_resume(resume, checkpoint_dir()) if resume and main else None
        if resume and parallel is not None:
            # Rank 0 stages first; a rank on the same machine finds its copy, a rank on another machine
            # (its own output folder) stages the file it was given itself.
            resume_name = _broadcast_text(resume_name)
            if not main and not os.path.isfile(os.path.join(checkpoint_dir(), resume_name)):
                resume_name = stage_resume(resume, checkpoint_dir())
        prompt = with_overrides(prompt, steps, resume_name)
        targets = training_targets(prompt, writers=main)
        prompt_id = str(uuid.uuid4())
        problem = _validate(execution, prompt_id, prompt, training_targets(prompt))  # the same on every rank
        if problem:
            return RunResult(False, problem)
        if parallel is not None:
            say(f"data parallel: {parallel.world} processes, rank 0 writes the files")
            for node_id, node in prompt.items():
                size = node["inputs"].get("batch_size")
                if node["class_type"] == "PrecisionTrainSettings" and isinstance(size, int) and size < parallel.world:
                    say(f"warning: node {node_id} (PrecisionTrainSettings) batch_size={size} is the global batch: "
                        f"{parallel.world - size} of {parallel.world} processes get no samples and only wait; set "
                        f"batch_size to at least {parallel.world} (a multiple of it is best)")
        say(f"running nodes {', '.join(targets)} of {len(prompt)} ({', '.join(prompt[t]['class_type'] for t in targets)})")
        output = [folder_paths.get_output_directory(), *folder_paths.get_folder_paths("loras")]
        before = _output_files(output)
        previous = getattr(comfy_server.PromptServer, "instance", None)
        comfy_server.PromptServer.instance = stand_in = ProgressServer(Progress(say) if main else None)
        try:
            executor = execution.PromptExecutor(stand_in, cache_type=execution.CacheType.CLASSIC,
                                                cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
            with _ctrl_c_cancels(mm, say, parallel is not None):
                executor.execute(prompt, prompt_id, {}, targets)
        finally:
            comfy_server.PromptServer.instance = previous
        written = sorted(_output_files(output) - before) if main else []
        for path in written:
            say(f"wrote {path}")
        if not executor.success:
            return RunResult(False, _error_text(executor.status_messages), written)
        return RunResult(True, None, written)
    finally:
        if parallel is not None:
            distributed.deactivate()


@contextlib.contextmanager
def _ctrl_c_cancels(mm, say: Callable[[str], None], parallel: bool):
    """The first Ctrl-C is the UI's Cancel (the train node finishes its step, writes a checkpoint and ends);
    a second one stops at once. Only in the main thread, where Python delivers signals. Under torchrun
    (which passes Ctrl-C on to every rank) the cancel goes through ``training.distributed`` so that all
    ranks stop at the same step boundary, none in the middle of a step."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    presses = []

    def handler(signum, frame):
        presses.append(signum)
        if len(presses) > 1:
            raise KeyboardInterrupt
        say("cancelling: the current step finishes and a checkpoint is written (Ctrl-C again to quit now)")
        if parallel:
            distributed.request_cancel()
        else:
            mm.interrupt_current_processing(True)

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        mm.interrupt_current_processing(False)


def _validate(execution, prompt_id: str, prompt: dict, targets: list[str]) -> str | None:
    """ComfyUI's own validation of what will run; the error text, or None. ComfyUI validates a prompt by
    its output nodes (the writers); the train nodes are validated one by one as well, so a training part
    without a writer is checked too."""
    import nodes

    from ..nodes.checks.graph import mark_prompt

    mark_prompt(prompt)  # what the server's on_prompt handler does for /prompt: rules across nodes
    needed = set(targets).union(*(_ancestors(prompt, t) for t in targets))
    missing = sorted((i for i in needed if prompt[i]["class_type"] not in nodes.NODE_CLASS_MAPPINGS), key=_order)
    if missing:
        return ("the workflow uses nodes this ComfyUI does not have: "
                + ", ".join(f"node {i} ({prompt[i]['class_type']})" for i in missing)
                + "; install the custom nodes that provide them (or leave out --only-this-pack)")
    trains = train_nodes(prompt)
    if any(t not in trains for t in targets):
        valid = asyncio.run(execution.validate_prompt(prompt_id, prompt, targets))
        if not valid[0]:
            return _validation_text(valid)
    validated: dict = {}
    for node_id in trains:
        ok, errors, _ = asyncio.run(execution.validate_inputs(prompt_id, prompt, node_id, validated))
        if not ok:
            return _validation_text((False, {"message": f"node {node_id} has invalid inputs"}, [],
                                     {node_id: {"errors": errors, "class_type": prompt[node_id]["class_type"]}}))
    return None


def _validation_text(valid: tuple) -> str:
    error, node_errors = valid[1], valid[3]
    lines = [f"the workflow does not validate: {error.get('message', error) if isinstance(error, dict) else error}"]
    for node_id, info in (node_errors or {}).items():
        for err in collapse(info.get("errors", [])):  # the pack's message once, not once per input
            lines.append(f"  node {node_id} ({info.get('class_type')}): {err.get('message')}: {err.get('details')}")
    return "\n".join(lines)


def _broadcast_text(text: str | None) -> str | None:
    import torch.distributed as dist

    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main(workflow: str, steps: int | None, resume: str | None) -> int:
    """The command line's body: run, print the outcome, return the exit status."""
    try:
        result = run(load_workflow(workflow), steps=steps, resume=resume)
    except WorkflowError as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 2
    if not result.success:
        rank = f" (rank {os.environ['RANK']})" if distributed.launched_by_torchrun() and "RANK" in os.environ else ""
        print(f"{PROG}{rank}: {result.error}", file=sys.stderr, flush=True)
        return 1
    return 0
