"""Moving KV blocks between workers: FP8 block codec, transports (NIXL, fallback), hand-off protocol.

Transports are looked up by name and imported lazily: importing this package never imports NIXL.
"""
