"""One gate for the widget values of every pack node: numbers, options, booleans and file names.

Why a gate of our own (tests/comfy/test_input_gate.py): ComfyUI (0.3.75 and 0.33) skips its min/max and option
checks for every input a node's ``validate_inputs`` names, and for all inputs when it takes ``**kwargs``;
NaN passes those checks anyway (``nan < min`` is False); values arriving through links are never checked.

Every pack node derives from ``PrecisionNode``:

- ``validate_inputs(**values)`` checks each value ComfyUI hands over against the node's own schema
  (``INPUT_TYPES``): FLOAT/INT through ``training.checks.number_problem`` with the declared min/max, COMBO
  against its options, BOOLEAN, STRING (text only: a lone UTF-16 surrogate is refused before it reaches an
  encoder), and the inputs named in ``FILE_NAME_INPUTS`` through ``file_names.name_problem``.
  Then the node's ``check(values)`` runs the rules that need no tensors (regexes, combinations, files that
  must exist). A linked input is not known yet during validation: ComfyUI hands it over as None, or, to an
  input-list node, as the tuple ``(None,)`` (a literal value comes as ``[value]``); such values are skipped.
- ``execute`` is wrapped (once, in ``__init_subclass__``) to run the same gate on the values it really
  receives, linked ones included, and raise ``ValueError`` before the node does anything.

Messages read ``<Node>: input '<name>'=<value> <problem>; <fix>``. ComfyUI files the message of
``validate_inputs`` under every input of the node; ``gate_errors`` keeps it once, under the input it names.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, ClassVar, Mapping

from ...training.checks import number_problem, show
from ..host import errors
from ..host.comfy_io import io
from .file_names import name_problem
from .graph import MARK  # a rule across nodes, refused through this input (graph.py): the node's check says it

MAX_LISTED_OPTIONS = 12
# Socket types whose real values are objects or hold tensors. A value typed into an API prompt (JSON: text, numbers,
# lists and dicts of those) can never be one, yet ComfyUI hands such a literal to the node unchecked, which then
# fails deep inside ("'str' object has no attribute 'clone'"). LOSS_MAP is left out: its real value is JSON-like.
SOCKET_KINDS = frozenset({"MODEL", "CLIP", "VAE", "LATENT", "CONDITIONING", "IMAGE", "MASK", "AUDIO", "VIDEO",
                          "TRAINING_STATE", "TRAIN_SETTINGS", "PREVIEW_SETTINGS"})


def _options_text(options: list) -> str:
    shown = ", ".join(repr(o) for o in options[:MAX_LISTED_OPTIONS])
    more = f", ... ({len(options)} options)" if len(options) > MAX_LISTED_OPTIONS else ""
    return f"[{shown}{more}]"


def _specs(cls: type) -> dict[str, tuple[Any, dict]]:
    """Input name -> (type, info) of the node's required and optional inputs (hidden ones left out)."""
    types = cls.INPUT_TYPES()
    out: dict[str, tuple[Any, dict]] = {}
    for section in ("required", "optional"):
        for name, entry in (types.get(section) or {}).items():
            out[name] = (entry[0], entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {})
    return out


def value_problem(kind: Any, info: Mapping[str, Any], value: Any, file_name: tuple[bool, bool] | None,
                  folder: str | None = None) -> str | None:
    """Why one widget value does not fit its declared type, or None. ``file_name``: (subfolders, empty_ok);
    ``folder``: the models folder a file-list combo lists."""
    if kind in ("FLOAT", "INT"):
        return number_problem(value, info.get("min"), info.get("max"), integer=kind == "INT")
    if kind == "COMBO" or isinstance(kind, list):
        options = list(kind if isinstance(kind, list) else info.get("options", []))
        if any(value == o and type(value) is type(o) for o in options):
            return None
        if folder is not None:
            listed = f" (choose one of {_options_text(options)})" if options else ""
            return f"is not in {folder}; put the file there and refresh the node list{listed}"
        return f"is not an option; choose one of {_options_text(options)}"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else "is not a boolean; use true or false"
    if kind in SOCKET_KINDS and _typed_in(value) and not (isinstance(value, dict) and MARK in value):
        article = "an" if kind[0] in "AEIOU" else "a"
        return (f"is a value typed into the prompt, not {article} {kind}; connect {article} {kind} output to it (in an "
                "API prompt: a link [node_id, output_index])")
    if kind == "STRING":
        if not isinstance(value, str):
            return f"is not text (got {type(value).__name__}); give a text value"
        surrogate = _surrogate(value)
        if surrogate is not None:
            return surrogate
        if file_name is not None:
            return name_problem(value, subfolders=file_name[0], empty_ok=file_name[1])
    return None


def _typed_in(value: Any) -> bool:
    """True for what JSON can hold (text, numbers, booleans, lists and dicts of them): a literal, never a socket's
    real value (a ModelPatcher, a dict holding tensors, a list of [tensor, dict] pairs, a dataclass)."""
    if isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_typed_in(v) for v in value)
    if isinstance(value, dict):
        return all(_typed_in(v) for v in value.values())
    return False


def _surrogate(text: str) -> str | None:
    """A lone UTF-16 surrogate (JSON's ``"\\ud800"``) is no character: no file, log or encoder takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"contains the lone UTF-16 surrogate {text[e.start]!r} at character {e.start}, which is not text "
                "(a broken copy or client); retype the value")
    return None


def _items(value: Any, listed: bool) -> list[Any]:
    """The values one input holds: an input-list node gets a list (a literal during validation: ``[value]``;
    at execution: the values) or, for a link during validation, the tuple ``(None,)``; other nodes one value."""
    return list(value) if listed and isinstance(value, (list, tuple)) else [value]


def _first(values: Mapping[str, Any]) -> dict[str, Any]:
    """Input-list nodes get every input as a list: the first item of each (None for an empty list or a link
    not resolved yet), for the node's own check."""
    return {k: (_items(v, True) or [None])[0] for k, v in values.items()}


def gate(cls: type, values: Mapping[str, Any]) -> str | None:
    """The first problem of ``values`` for node ``cls`` as a full message (node, input, value, fix), or None."""
    specs = _specs(cls)
    listed = bool(cls.INPUT_IS_LIST)
    names: Mapping[str, tuple[bool, bool]] = getattr(cls, "FILE_NAME_INPUTS", {})
    folders: Mapping[str, str] = getattr(cls, "FILE_LIST_INPUTS", {})
    for name, value in values.items():
        if name not in specs or value is None:
            continue
        kind, info = specs[name]
        for item in _items(value, listed):  # None: linked, not known until execution
            problem = None if item is None else value_problem(kind, info, item, names.get(name), folders.get(name))
            if problem is not None:
                return f"{cls.NODE}: input '{name}'={show(item)} {problem}"
    own = cls.check(_first(values) if listed else dict(values))
    return None if own is None else f"{cls.NODE}: {own}"


def _gated(execute: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(execute)
    params = list(signature.parameters.values())[1:]  # after cls

    @functools.wraps(execute)
    def checked(cls, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(cls, *args, **kwargs).arguments
        values: dict[str, Any] = {}
        for p in params:
            if p.name in bound:
                values.update(bound[p.name] if p.kind is p.VAR_KEYWORD else {p.name: bound[p.name]})
        errors.install_log_prefix()  # a pack module imported since registration logs with the prefix too
        problem = gate(cls, values)
        if problem is not None:
            raise ValueError(errors.prefixed(problem))
        with errors.boundary():  # the pack's messages leave every node with the one prefix
            return execute(cls, *args, **kwargs)

    checked.precision_gated = True  # type: ignore[attr-defined]
    return checked


class PrecisionNode(io.ComfyNode):
    """Base of every pack node: the gate above in validation and before execution.

    Subclasses set ``NODE`` (their node id), optionally ``FILE_NAME_INPUTS`` (input -> (subfolders allowed,
    empty allowed)) and ``FILE_LIST_INPUTS`` (combo input -> the models folder it lists, named in the
    error), and override ``check`` for tensor-free rules beyond one value's type and range.
    """

    NODE: ClassVar[str] = ""
    FILE_NAME_INPUTS: ClassVar[dict[str, tuple[bool, bool]]] = {}
    FILE_LIST_INPUTS: ClassVar[dict[str, str]] = {}  # combo input -> the models folder it lists

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        execute = cls.__dict__.get("execute")
        # ComfyUI clones node classes per run (shallow_clone_class): wrap each execute only once.
        if isinstance(execute, classmethod) and not getattr(execute.__func__, "precision_gated", False):
            cls.execute = classmethod(_gated(execute.__func__))

    @classmethod
    def validate_inputs(cls, **values: Any) -> bool | str:
        problem = gate(cls, values)
        return True if problem is None else errors.prefixed(problem)

    @classmethod
    def check(cls, values: dict[str, Any]) -> str | None:
        """Node-specific rules without tensors: ``"input 'x'=<value> <problem>; <fix>"`` or None. Values of
        linked inputs are None during validation (input-list nodes: the first item of each input)."""
        return None
