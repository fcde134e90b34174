"""Training: Train Settings, Train LoRA, Preview Settings and Loss Graph, their glue over training/ (model
functions, data, previews, checkpoints and states, the job slot) and the job's HTTP routes."""
