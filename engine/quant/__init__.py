"""Linear weights at the precision ``EngineConfig.weights`` names: GGUF blocks, int8, int4, bf16."""
