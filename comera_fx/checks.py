"""Argument checks shared by the entry points of several layers (config, runtime): kept at the bottom layer so that
any of them may call them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_config_type(call: str, value: Any, config_type: type, example: str) -> None:
    """TypeError at the call when ``value`` is neither None nor a ``config_type``: a dict or a bare number handed
    where a config belongs otherwise fails later, far from the call, on a missing attribute. A dict's error spells
    the config it meant (one spelling of each option: the dataclass, validated in ``__post_init__``)."""
    if value is None or isinstance(value, config_type):
        return
    name = config_type.__name__
    if isinstance(value, Mapping):
        fix = f"{name}({', '.join(f'{key}={item!r}' for key, item in value.items())})"
    else:
        fix = example
    raise TypeError(f"{call} takes a {name} (or None), not {type(value).__name__} {value!r}; pass {fix}")
