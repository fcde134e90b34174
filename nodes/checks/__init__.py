"""Checks of what reaches the pack from outside: every widget value (the gate every node derives from), file
names from widgets and the browser, one error per input in ComfyUI's answer, and rules across nodes."""
