"""What attention a training run actually ran: said before the first step, counted over the run, recorded.

Train LoRA shows ``start_lines()`` on the node before step 1 (the pack's override, the other pack's override it
keeps or does not call, or another pack's override running alone), and writes ``metadata()`` into the saved LoRA:
the calls the pack's override ran against every attention call the model made (counted as the family coverage
tests count them: ComfyUI's attention functions and direct SDPA calls, ``reach.counting``), and the calls the kept
override ran as the kernel. The recorded ``ss_attn_*`` settings are those of the override that ran
(``lora.glue.attention_metadata``), so a scale another node removed is not claimed.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

from ...attention.config import AUTO_BACKEND
from .glue import composition_note, foreign_override, get_attention_override
from .other_overrides import describe_override
from .reach import counting

log = logging.getLogger(__name__)

META_CALLS = "precision_lora_attention_calls"
META_KEPT = "precision_lora_attention_kept_override"
META_OTHER = "precision_lora_attention_other_override"


class AttentionAccount:
    """The run's attention, before (``start_lines``) and after (``metadata``, ``end_line``)."""

    def __init__(self, model: Any) -> None:
        self.override = get_attention_override(model)
        self.other = foreign_override(model)
        self._before = self.override.calls() if self.override is not None else None
        self.count = None

    def start_lines(self) -> list[str]:
        if self.override is not None and self.override.previous is not None:
            return [f"attention: Patch Attention's settings, with the override another node set: "
                    f"{composition_note(self.override)}"]
        if self.other is not None:
            return [f"attention: another node's override runs every attention call, {describe_override(self.other)}; "
                    "no Patch Attention (Precision) on this model, so the saved LoRA records ComfyUI's default scale"]
        return []

    def _ran(self) -> tuple[int, int, int] | None:
        if self.override is None or self.count is None:
            return None
        now = self.override.calls()
        return (now["calls"] - self._before["calls"], self.count.calls,
                now["previous"] - self._before["previous"])

    def metadata(self) -> dict[str, str]:
        if self.other is not None:
            return {META_OTHER: describe_override(self.other)}
        ran = self._ran()
        if ran is None:
            return {}
        ours, total, kept = ran
        md = {META_CALLS: f"{ours}/{total}"}
        if self.override.previous is not None:
            role = "kernel" if self.override.cfg.backend == AUTO_BACKEND else "not called"
            md[META_KEPT] = f"{describe_override(self.override.previous)}: {role}, {kept} calls"
        return md

    def end_line(self) -> str | None:
        ran = self._ran()
        if ran is None:
            return None
        ours, total, kept = ran
        line = f"attention: the pack's override ran {ours} of the model's {total} attention calls"
        if self.override.previous is not None:
            line += f"; {describe_override(self.override.previous)} ran {kept} of them as the kernel"
        return line


@contextlib.contextmanager
def attention_account(model: Any) -> Iterator[AttentionAccount]:
    """Counts the model's attention calls within the block (the training run)."""
    account = AttentionAccount(model)
    with counting() as count:
        account.count = count
        try:
            yield account
        finally:
            line = account.end_line()
            if line is not None:
                log.info("PrecisionTrainLoRA: %s", line)
