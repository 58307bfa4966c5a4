"""Hugging Face Llama checkpoints: `config` (config.json <-> LlamaConfig), `tensors` (names, layouts, safetensors
files) and `convert` (`shardkit import-hf`, `shardkit export --format hf`)."""
