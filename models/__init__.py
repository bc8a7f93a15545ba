"""The Flax Llama-3 model: config, RoPE, attention, layers and checkpoint loading."""
