"""``env.target``: the ``"module:ClassName"`` a user names for their environment or agent,
imported and checked to be the kind of class it must be."""

from __future__ import annotations

import importlib
from typing import TypeVar

T = TypeVar("T")


def import_target_class(target: str, base: type[T], base_name: str) -> type[T]:
    """Import ``target`` (``"module:ClassName"``, the value of ``env.target``) and check that
    it is a subclass of ``base`` (``base_name``: how the error spells it)."""
    module_name, separator, class_name = target.partition(":")
    if not separator or not module_name or not class_name:
        raise ValueError(f"env.target={target!r} must have the form 'module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(
            f"env.target={target!r}: cannot import module {module_name!r}: {error}; list the "
            "folder that holds it in env.python_path (or install it as a package)"
        ) from error
    found = getattr(module, class_name, None)
    if found is None:
        raise ImportError(f"env.target={target!r}: module {module_name!r} has no {class_name!r}")
    if not isinstance(found, type) or not issubclass(found, base):
        raise TypeError(f"env.target={target!r} is not a subclass of {base_name}")
    return found
