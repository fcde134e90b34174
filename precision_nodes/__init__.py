"""ComfyUI glue: the product nodes, routes and adapters. With demo/, the only packages that import ComfyUI."""
