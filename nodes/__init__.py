"""ComfyUI glue: the product nodes, routes and adapters. With demo/, the only packages that import ComfyUI.

One sub-package per area, bottom to top (tests/unit/test_layering.py enforces the order):
``host`` (ComfyUI's API and version differences) -> ``checks`` (input gate, file names, rules across nodes) ->
``model`` (what a model is, loading it, data checked against it) -> ``attention``, ``dataset`` -> ``lora`` ->
``train``, ``probe`` -> ``extension.py`` (registration). Each area's nodes are in its ``node.py``; ComfyUI
glue in ``glue.py``; HTTP routes in ``routes.py``.

The name matches ComfyUI's own ``nodes.py`` on purpose (the design's layout): ComfyUI loads the pack as one
package, so this is ``<pack>.nodes`` there; tools and tests reach it through the loaded pack
(``tests/comfy_harness.pack_module("nodes.train.glue")``), never by the short name ``nodes``.
"""
