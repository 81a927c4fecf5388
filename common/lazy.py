"""Module attributes imported on first use (PEP 562), for packages whose submodules pull in heavy libraries that
many processes never need (aiortc behind signaling and transport.webrtc: ~0.2-0.4 s of every start)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `names` maps an attribute to the relative submodule that defines it;
    the first access imports it and keeps the value in `namespace` (the package's globals), so later ones are
    plain lookups."""
    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module, package), name)
        return value
    return __getattr__
