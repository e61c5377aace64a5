"""Connectors by name, imported only when picked: importing this package imports neither Ray nor
the ``kubernetes`` client.

- ``ray`` (``ray.py``): adds and removes worker actors of the running local cluster through the
  controller.
- ``kubernetes`` (``kubernetes.py``): sets ``replicas`` of the KubeRay RayCluster worker groups.
"""

from __future__ import annotations

import importlib

CONNECTORS = {
    "ray": "planner.connectors.ray:RayConnector",
    "kubernetes": "planner.connectors.kubernetes:KubeRayConnector",
}


def connector_class(name: str) -> type:
    """The connector class registered as ``name``; ValueError for an unknown name."""
    if name not in CONNECTORS:
        raise ValueError(f"unknown connector {name!r}; choose one of {sorted(CONNECTORS)}")
    module_name, class_name = CONNECTORS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
