"""Import the pack's pure packages by their short names (``attention``, ``training``, ``lora``, ``probe``)
outside ComfyUI: unit tests, benches, tools.

Inside ComfyUI the pack is one package and ``lora`` reaches ``training`` by a relative import
(``from ..training.files import atomic_write``). Imported as top-level packages that import would fail
("beyond top-level package"), so ``install()`` loads the repository root as the package ``PACK`` (its
``__init__`` imports nothing) and makes each short name an alias of the sub-package: ``lora.file`` *is*
``PACK.lora.file``, one module object under two names, so classes and exceptions compare equal.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK = "precision_lora_pack"
PURE = ("attention", "training", "lora", "probe", "data")


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in PURE:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f"{PACK}.{spec.name}")

    def exec_module(self, module):  # already executed under its real name
        pass


def install() -> None:
    """Idempotent: register the root package and the short-name aliases in this process."""
    if PACK not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK, os.path.join(ROOT, "__init__.py"),
                                                      submodule_search_locations=[ROOT])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
