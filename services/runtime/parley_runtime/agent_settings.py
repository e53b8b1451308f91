"""An agent's settings: where ``get_setting`` looks, and how setting values are read.

``get_setting`` never reads the process environment. Many agents share one runtime process, so
falling through to ``os.environ`` would hand every agent the host's own credentials (the model
API keys, the database URL) whether or not the operator granted them. A host that wants some
environment variables visible folds them into ``host_settings`` explicitly.

Unset means missing, ``None``, or a string that is blank after trimming: elizaOS chains the levels
with ``||``, so ``""`` falls through to the next level, and its environment reader treats a blank
value as unset; a stray ``KEY: ""`` in a character must not hide the host's real value. Unlike
JavaScript's ``||``, ``False`` and ``0`` are values: a character saying ``FEATURE: false`` shadows a
host-wide ``FEATURE=true``, as the string ``"false"`` does in elizaOS. Values are returned as stored
(no ``"true"`` → ``True`` coercion); read them with ``setting_bool`` and ``setting_list``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

from . import errors

__all__ = [
    "TRAJECTORY_LOGGING_VARIABLE",
    "get_setting",
    "setting_bool",
    "setting_int",
    "setting_list",
    "trajectory_logging_enabled",
]

TRAJECTORY_LOGGING_VARIABLE: Final = "PARLEY_TRAJECTORY_LOGGING"

_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


def get_setting(
    key: str,
    *,
    secrets: Mapping[str, str],
    settings: Mapping[str, object],
    host_settings: Mapping[str, object],
) -> object | None:
    """The first set value of ``key``, in the spec's order, or ``None``.

    The order: the character's (decrypted) secrets, its settings (top level),
    ``settings["extra"]``, ``settings["secrets"]``, its env map ``settings["env"]``, then the
    settings map the host passed in. A nested level that is not a mapping is skipped.
    """
    for value in _levels(key, secrets, settings, host_settings):
        if _is_set(value):
            return value
    return None


def _levels(
    key: str, secrets: Mapping[str, str], settings: Mapping[str, object], host: Mapping[str, object]
) -> Iterator[object]:
    yield secrets.get(key)
    yield settings.get(key)
    for section in ("extra", "secrets", "env"):
        nested = settings.get(section)
        if isinstance(nested, Mapping):
            yield nested.get(key)
    yield host.get(key)


def _is_set(value: object) -> bool:
    return value is not None and not (isinstance(value, str) and not value.strip())


def setting_bool(value: object) -> bool | None:
    """``True``/``False`` for a recognised boolean spelling, else ``None``.

    Strings ``true/1/yes/on`` and ``false/0/no/off`` (trimmed, any case); bools as they are; the
    integers ``1`` and ``0`` too, because YAML and JSON characters write ``FLAG: 1``.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return {1: True, 0: False}.get(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    return None


def setting_int(value: object) -> int | None:
    """An integer setting: an ``int`` as it is, a string of digits (trimmed, an optional sign) as
    its number; ``None`` for anything else (a bool, a fraction, words, unset)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def setting_list(value: object) -> list[str]:
    """A setting as a list of strings.

    A list or tuple gives its items as strings (``None`` items dropped); a string is split on
    commas, each part trimmed and empty parts dropped; ``None`` gives ``[]``; any other value is a
    one-item list.
    """
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple):
        return [str(item) for item in value if item is not None]
    return [str(value)]


def trajectory_logging_enabled(raw: str | None, environment: str) -> bool:
    """Whether turns record their trajectory, from ``PARLEY_TRAJECTORY_LOGGING``.

    A truthy value enables and a falsy one disables. Unset or blank means the environment's
    default: on in ``development``, off in ``test``, ``production`` and anything else
    (trajectories hold prompts and user text, so an unknown environment fails closed). Any other
    value is a start-up error: a typo such as ``ture`` must not silently pick a default.
    """
    if raw is None or not raw.strip():
        return environment == "development"
    enabled = setting_bool(raw)
    if enabled is None:
        shown = raw.strip()
        shown = shown if len(shown) <= 32 else shown[:32] + "…"
        raise errors.TRAJECTORY_LOGGING_INVALID(
            f"{TRAJECTORY_LOGGING_VARIABLE}={shown!r} is not a boolean",
            hint=f"set {TRAJECTORY_LOGGING_VARIABLE} to true or false (1/0, yes/no, on/off also work), "
            "or leave it unset: on in development, off in test and production",
        )
    return enabled
