"""Command-line options generated from config dataclasses.

Each field becomes ``--[prefix-]field-name`` with the field's type, its default, and its
attribute docstring as help, so a config and its CLI can never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from pathlib import Path

_SCALARS = {"int": int, "float": float, "str": str, "Path": Path}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right after each field, inherited ones included."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or "__dataclass_fields__" not in vars(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, following in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group(cls.__name__)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + (prefix + "-" if prefix else "") + f.name.replace("_", "-")
        kind, optional = _parse_type(str(f.type))
        help_text = f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%")  # argparse %-formats help
        dest = _dest(prefix, f.name)
        if kind == "bool":
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif kind in _SCALARS:
            group.add_argument(flag, dest=dest, type=_SCALARS[kind], default=f.default, help=help_text)
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no CLI mapping for type {f.type}")


def dataclass_from_args(cls: type, args: argparse.Namespace, prefix: str = "", **overrides):
    """Build ``cls`` from parsed options; ``overrides`` fill the fields that have no option."""
    values = {
        f.name: getattr(args, _dest(prefix, f.name))
        for f in dataclasses.fields(cls)
        if f.name not in overrides and hasattr(args, _dest(prefix, f.name))
    }
    return cls(**values, **overrides)


def _dest(prefix: str, name: str) -> str:
    return f"{prefix.replace('-', '_')}_{name}" if prefix else name


def _parse_type(annotation: str) -> tuple[str, bool]:
    parts = [p.strip() for p in annotation.split("|")]
    optional = "None" in parts
    kinds = [p for p in parts if p != "None"]
    return (kinds[0] if len(kinds) == 1 else annotation), optional
