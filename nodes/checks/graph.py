"""Rules across nodes, refused when the prompt is queued, before anything runs.

ComfyUI validates each node on its own, and a linked input (Train LoRA's ``settings``) has no value during
validation, so Train LoRA cannot see that its settings ask for caption dropout: the run used to be refused
only after every caption was encoded (minutes with T5-XXL). ComfyUI's ``on_prompt`` handlers see the whole
prompt before validation; ``mark_prompt`` finds each rule broken there and hands the message to the node's
own validation through the input at fault (``{"precision_lora_refused": message}`` as that input's value;
``PrecisionTrainLoRA.check`` returns it), so ComfyUI's answer (400, ``node_errors``) names the node and the
input like any other validation error. A prompt that breaks no rule is left unchanged.

Rules (a setting on the PrecisionTrainSettings node linked to Train LoRA's ``settings``, given as a value):
- ``caption_dropout`` > 0 needs ``empty_conditioning`` connected;
- ``dop_multiplier`` > 0 needs ``class_conditioning`` connected.
"""
from __future__ import annotations

from typing import Any, Iterator

MARK = "precision_lora_refused"
TRAIN, SETTINGS = "PrecisionTrainLoRA", "PrecisionTrainSettings"
RULES = (  # (setting, the Train LoRA input it needs, what to connect there)
    ("caption_dropout", "empty_conditioning", "the empty caption's conditioning (CLIPTextEncode with an empty text)"),
    ("dop_multiplier", "class_conditioning", "the class prompt's conditioning (the caption without the trigger)"),
)


def _settings_node(prompt: dict, inputs: dict) -> tuple[str, dict] | None:
    link = inputs.get("settings")
    if not (isinstance(link, list) and len(link) == 2):
        return None
    source = prompt.get(str(link[0]))
    if not isinstance(source, dict) or source.get("class_type") != SETTINGS:
        return None
    values = source.get("inputs")
    return (str(link[0]), values) if isinstance(values, dict) else None


def _valid(values: dict) -> bool:
    """The settings node's own validation accepts its values (linked ones are checked when they arrive): a
    bad value there is that node's error alone, not also Train LoRA's."""
    import nodes  # ComfyUI's registry: the settings node as ComfyUI validates it (.train imports this module)

    settings = nodes.NODE_CLASS_MAPPINGS.get(SETTINGS)
    if settings is None:
        return True
    return settings.validate_inputs(**{k: v for k, v in values.items() if not isinstance(v, list)}) is True


def problems(prompt: dict) -> Iterator[tuple[str, str, str]]:
    """(Train LoRA node id, input at fault, message) for each rule the prompt breaks."""
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or node.get("class_type") != TRAIN or not isinstance(node.get("inputs"), dict):
            continue
        inputs = node["inputs"]
        found = _settings_node(prompt, inputs)
        if found is None:
            continue
        settings_id, values = found
        if not _valid(values):
            continue  # the settings node's own validation names its bad value; one error, at its source
        for setting, needed, what in RULES:
            value = values.get(setting)
            on = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            if on and inputs.get(needed) is None:
                yield node_id, needed, (
                    f"input '{needed}' is not connected, but input '{setting}'={value} of node {settings_id} "
                    f"({SETTINGS}) needs it: connect {what} to '{needed}', or set {setting} to 0")


def mark_prompt(prompt: Any) -> Any:
    """``prompt`` with each broken rule's message placed on the input at fault (in place); see the module."""
    if isinstance(prompt, dict):
        for node_id, name, message in list(problems(prompt)):
            prompt[node_id]["inputs"][name] = {MARK: message}
    return prompt


def on_prompt(json_data: Any) -> Any:
    """ComfyUI ``on_prompt`` handler: marks ``json_data["prompt"]`` (see ``mark_prompt``)."""
    if isinstance(json_data, dict):
        mark_prompt(json_data.get("prompt"))
    return json_data


def refusal(value: Any) -> str | None:
    """The message ``mark_prompt`` left on an input, or None (input-list nodes get values as lists)."""
    if isinstance(value, list) and value:
        value = value[0]
    return value.get(MARK) if isinstance(value, dict) and isinstance(value.get(MARK), str) else None
