"""The control plane, in three rooms by job, above them the router actor, below them what all share.

    control/    the cluster itself: controller, placement, Ray nodes, launch     (imports replica and below)
    replica.py  the router actor: a front end over a routing policy               (imports frontend and below)
    frontend/   what callers talk to: gRPC and the OpenAI/KServe APIs             (imports routing and below)
    routing/    where a request goes: policy, prefix index, tokenizer, workers    (imports config and errors)
    config.py, errors.py, client.py   the router's settings, its errors, the Python client (import no room)

Imports only `proto` and `kv_store` of splitserve; workers are reached through Ray handles. The
planner and the CLI sit above router/ and are never imported by it (tests/unit/test_layering.py).
"""
