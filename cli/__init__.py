"""The `splitserve` command, above every room it drives: main.py (up, head, worker, router, plan,
generate, status, node-cert), args.py (a dataclass's fields as argparse options) and plan.py
(`splitserve plan`). No room imports it."""
