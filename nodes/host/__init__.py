"""ComfyUI itself: its V3 node API (one import point), custom socket types, the differences between the
supported ComfyUI versions, and start-up housekeeping. Imports nothing else of nodes/."""
