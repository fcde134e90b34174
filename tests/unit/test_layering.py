"""The package map of docs/DEVELOPING.md, enforced on the source: who may import whom, no circles, no demo.

Every import statement counts (module level, inside functions, under ``TYPE_CHECKING``): a lazy import is
still a dependency a reader has to follow.
"""
from __future__ import annotations

import ast
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRODUCT = ("attention", "training", "data", "lora", "probe", "nodes")
# What each package may import of the pack (besides itself). Bottom to top:
# attention, training -> data, lora -> probe -> nodes; demo/ sits beside the product, on top of it.
ALLOWED = {
    "attention": set(),
    "training": set(),
    "data": {"training"},
    "lora": {"attention", "training"},
    "probe": {"attention", "training", "lora"},
    "nodes": {"attention", "training", "data", "lora", "probe"},
    "runner": {"attention", "training", "data", "lora", "probe", "nodes"},
    "demo": {"attention", "training", "data", "lora", "probe", "nodes"},
}
PACK_PACKAGES = set(ALLOWED) | {"tests", "bench", "scripts"}
# An absolute ``import nodes`` is ComfyUI's nodes.py (the pack is one package: its own modules are imported
# relatively), so that name never counts as the pack's nodes/.
COMFY_NAMES = {"nodes"}


def _modules(package: str) -> dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = os.path.join(dirpath, name)
    return found


def _imports(module: str, path: str) -> set[str]:
    """Pack modules that ``module`` imports (relative imports resolved; ``from . import x`` -> ``pkg.x``)."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in PACK_PACKAGES - COMFY_NAMES)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if (node.module or "").split(".")[0] in PACK_PACKAGES - COMFY_NAMES:
                    out.add(node.module)
                continue
            base = package.split(".")
            base = base[:len(base) - (node.level - 1)]
            # base == [] is the pack root (``from ..training.files import x`` in lora/file.py).
            target = ".".join(base + ([node.module] if node.module else []))
            if not target:  # ``from .. import training``
                out.update(a.name for a in node.names)
                continue
            if node.module:
                # ``from .train import node as train`` imports the sub-module ``train.node``: name both (the
                # graph keeps a name only where it is a module and folds a function into its module).
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
            else:
                out.update(f"{target}.{a.name}" for a in node.names)
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    """module -> the modules it imports (parsed once per session; callers read it, never change it)."""
    modules = {}
    for package in ALLOWED:
        modules.update(_modules(package))
    graph = {}
    for module, path in modules.items():
        deps = set()
        for target in _imports(module, path):
            # ``from pkg.sub import name``: the module, whether ``name`` is a function or a sub-module.
            deps.add(target if target in modules else target.rpartition(".")[0] if target.rpartition(".")[0] in modules
                     else target)
        graph[module] = deps - {module}
    return graph


def test_each_package_imports_only_the_packages_below_it():
    bad = []
    for module, deps in _graph().items():
        top = module.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                bad.append(f"{module} imports {dep}")
    assert bad == []


# Inside nodes/ (the only product package that imports ComfyUI), bottom to top: host (ComfyUI's API and its
# version differences) -> checks (the input gate, file names) -> model (what a model is, loading it, data
# against it) -> attention, dataset -> lora -> train, probe -> extension (registration).
NODES_ALLOWED = {
    "host": set(),
    "checks": {"host"},
    "model": {"host", "checks"},
    "attention": {"host", "checks", "model"},
    "dataset": {"host", "checks", "model"},
    "lora": {"host", "checks", "model", "attention"},
    "train": {"host", "checks", "model", "attention", "dataset", "lora"},
    "probe": {"host", "checks", "model", "attention", "lora"},
    "extension": {"host", "checks", "model", "attention", "dataset", "lora", "train", "probe"},
}


def test_each_node_area_imports_only_the_areas_below_it():
    graph = _graph()
    areas = {m.split(".")[1] for m in graph if m.startswith("nodes.")}
    assert areas == set(NODES_ALLOWED)  # a new area is placed in the order above, not left unchecked
    bad = []
    for module, deps in graph.items():
        if not module.startswith("nodes."):
            continue
        area = module.split(".")[1]
        for dep in deps:
            if dep.startswith("nodes.") and dep.split(".")[1] not in NODES_ALLOWED[area] | {area}:
                bad.append(f"{module} imports {dep}")
    assert bad == []


def test_no_product_module_imports_demo_or_test_code():
    bad = [f"{m} imports {d}" for m, deps in _graph().items() if m.split(".")[0] in PRODUCT
           for d in deps if d.split(".")[0] in ("demo", "tests", "bench", "scripts")]
    assert bad == []


def test_no_import_circle_in_the_product_packages():
    full = _graph()
    graph = {m: {d for d in deps if d in full} for m, deps in full.items() if m.split(".")[0] in PRODUCT}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert cycles == []


def test_the_layering_test_sees_the_imports_it_guards():
    # The checks above pass trivially if the parser misses imports: pin a few known edges.
    graph = _graph()
    assert "training.files" in graph["lora.file"]
    assert "lora.lowrank" in graph["probe.survival"]
    assert "nodes.model.load" in graph["demo.tiny_models"]
    assert "nodes.train.node" in graph["nodes.extension"]
    assert "nodes.attention.glue" in graph["nodes.lora.glue"]
    assert "nodes" not in graph["nodes.checks.graph"]  # its ``import nodes`` is ComfyUI's nodes.py
