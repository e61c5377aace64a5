"""Control plane: gRPC frontend, routing policy and global prefix index, Ray controller, planner, CLI.

Imports only `proto` and `kv_store` of splitserve; workers are reached through Ray handles.
"""
