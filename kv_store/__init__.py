"""The KV block: key spec, block layout, FP8 math and the block pool.

`kv_store` imports nothing else of splitserve. `kv_store.keys` does not import torch, so the
router can hash prompts without loading it.
"""
