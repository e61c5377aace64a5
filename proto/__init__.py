"""gRPC API definitions (package ``splitserve.v1``) and their generated Python code. No logic."""
