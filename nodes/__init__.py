"""ComfyUI glue: the only package of the pack that imports ComfyUI."""
