"""Precision Patch Attention: the node, and the glue that binds ComfyUI's attention arguments to attention/."""
