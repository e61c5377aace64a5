"""Model building blocks: norms, rotary embeddings, paged attention, dense and MoE MLPs."""
