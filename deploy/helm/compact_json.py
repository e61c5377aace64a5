"""JSON that stays readable in review: two-space indents, but any value that fits on one line
stays on one line (generated schema rules and dashboard targets read one per line)."""

from __future__ import annotations

import json

WIDTH = 120


def dumps(value, indent: int = 0) -> str:
    """``value`` as JSON text, nested values kept on one line when they fit in WIDTH columns."""
    flat = json.dumps(value)
    if len(flat) + indent <= WIDTH or not isinstance(value, (dict, list)) or not value:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 2)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dumps(v, indent + 2) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
