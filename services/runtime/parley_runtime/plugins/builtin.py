"""The plugins every runtime has, by the name a character uses for them."""

from __future__ import annotations

from ..sdk import Plugin
from .basic import basic_capabilities

BUILTIN_PLUGINS: dict[str, Plugin] = {"basic_capabilities": basic_capabilities}
