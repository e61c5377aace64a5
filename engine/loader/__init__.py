"""Checkpoint loading: HF safetensors directories and the GGUF converter for bundled models."""
