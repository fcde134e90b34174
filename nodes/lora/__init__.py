"""LoRA nodes (Attach, Save, Load), the glue that puts lora/ adapters on a ModelPatcher, and the LoRA info
route."""
