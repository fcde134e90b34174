"""Every registered node has a help page in ComfyUI's node documentation panel: ``web/docs/<NodeId>.md``.

ComfyUI's frontend shows ``<WEB_DIRECTORY>/docs/<NodeId>.md`` of a custom node in its node documentation panel.
The nodes are the ones the pack's ``comfy_entrypoint`` registers (product and demo nodes), read from the pack
as ComfyUI loaded it; each page must name every input and output of the node's schema in its own section, so
an input added without documentation fails here.
"""
from __future__ import annotations

import asyncio
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "web", "docs")
SECTIONS = ("Inputs", "Outputs", "Typical wiring", "Common mistakes")


@pytest.fixture(scope="module")
def registered(pack):
    """{node id: schema} of every node the pack's V3 entry point registers."""
    extension = asyncio.run(pack.comfy_entrypoint())
    nodes = asyncio.run(extension.get_node_list())
    return {schema.node_id: schema for schema in (node.define_schema() for node in nodes)}


def _page(node_id: str) -> str:
    with open(os.path.join(DOCS, f"{node_id}.md"), encoding="utf-8") as f:
        return f.read()


def _sections(text: str) -> dict[str, str]:
    """``## Title`` -> the text up to the next ``## `` heading."""
    parts = re.split(r"^## +(.+?)\s*$", text, flags=re.M)
    return {title: body for title, body in zip(parts[1::2], parts[2::2])}


def _listed(section: str) -> set[str]:
    """The names a section's bullet lines start with: "- `name` (TYPE): ..."."""
    return set(re.findall(r"^- `([^`]+)`", section, re.M))


def _output_name(output) -> str:
    return output.display_name or output.id or output.get_io_type()


def test_the_pack_registers_its_product_and_demo_nodes(registered):
    assert len(registered) >= 17
    assert {"PrecisionTrainLoRA", "PrecisionLoadLoRA", "PrecisionDemoLatent"} <= set(registered)


def test_every_registered_node_has_a_help_page(registered):
    missing = sorted(n for n in registered if not os.path.isfile(os.path.join(DOCS, f"{n}.md")))
    assert not missing, f"no help page in web/docs/ for: {missing}"
    extra = sorted(f for f in os.listdir(DOCS) if f.endswith(".md") and f[:-3] not in registered)
    assert not extra, f"help pages for nodes the pack does not register: {extra}"


def test_each_page_documents_the_node(registered):
    problems = []
    for node_id, schema in sorted(registered.items()):
        text = _page(node_id)
        sections = _sections(text)
        if not text.startswith(f"# {schema.display_name}\n"):
            problems.append(f"{node_id}: the page should start with '# {schema.display_name}'")
        if f"`{node_id}`" not in text:
            problems.append(f"{node_id}: the page does not name the node id")
        if len(text.split()) < 120:
            problems.append(f"{node_id}: {len(text.split())} words; say what the node does, how to wire it and "
                            "the mistakes users make")
        absent = [s for s in SECTIONS if s not in sections]
        if absent:
            problems.append(f"{node_id}: no section {absent}")
            continue
        inputs, outputs = [i.id for i in schema.inputs], [_output_name(o) for o in schema.outputs]
        listed_in, listed_out = _listed(sections["Inputs"]), _listed(sections["Outputs"])
        if set(inputs) - listed_in:
            problems.append(f"{node_id}: inputs without a line under '## Inputs': {sorted(set(inputs) - listed_in)}")
        if listed_in - set(inputs):
            problems.append(f"{node_id}: '## Inputs' lists what the node does not have: {sorted(listed_in - set(inputs))}")
        if set(outputs) - listed_out:
            problems.append(f"{node_id}: outputs without a line under '## Outputs': {sorted(set(outputs) - listed_out)}")
        if listed_out - set(outputs):
            problems.append(f"{node_id}: '## Outputs' lists what the node does not have: {sorted(listed_out - set(outputs))}")
        if not re.search(r"^- ", sections["Common mistakes"], re.M):
            problems.append(f"{node_id}: '## Common mistakes' has no item")
    assert not problems, "\n".join(problems)


def test_pages_are_plain_markdown():
    """No HTML, no images: the panel renders markdown, and a page must read the same in a text editor."""
    for name in sorted(os.listdir(DOCS)):
        text = _page(name[:-3])
        prose = re.sub(r"`[^`]*`", "", text)  # in a code span, <name> is text
        assert not re.search(r"<[a-zA-Z/][^>]*>", prose), f"{name}: HTML tag (or a <placeholder> outside backticks)"
        assert "![" not in text, f"{name}: image"
