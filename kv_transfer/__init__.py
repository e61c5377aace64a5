"""Moving KV blocks between workers: FP8 block codec, transports (NIXL), hand-off protocol.

Transports are looked up by name and imported lazily: importing this package never imports NIXL.
Reading order: README.md, protocol.py, codec.py, segments.py, nixl_transport.py.
"""
