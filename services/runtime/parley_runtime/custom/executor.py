"""Running a custom action's handler (http, shell or code), and reading the operator's file of
definitions; nothing here knows about agents or turns."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import errors
from ..secrets import Redactor
from .code import run_code
from .definitions import (
    SECRET_PREFIX,
    CodeHandler,
    CustomActionDef,
    HttpHandler,
    ShellHandler,
    parse_definitions,
)
from .http import RESPONSE_CHARS, TIMEOUT_SECONDS, run_http
from .process import ProcessOutcome
from .shell import CommandNotFound, run_shell
from .ssrf import Guard, Resolver


@dataclass(frozen=True)
class CustomActionSettings:
    allow_hosts: tuple[str, ...] = ()
    shell_enabled: bool = False
    code_enabled: bool = False
    http_timeout: float = TIMEOUT_SECONDS
    output_chars: int = RESPONSE_CHARS


@dataclass(frozen=True)
class TestResult:
    ok: bool
    output: str


class Executor:
    """Runs a definition's handler; the outcome's text never holds the definition's credentials."""

    def __init__(self, settings: CustomActionSettings, resolver: Resolver | None = None) -> None:
        self.settings = settings
        self.guard = Guard(settings.allow_hosts, resolver)

    def disabled(self, definition: CustomActionDef) -> str | None:
        kind = definition.handler.type
        if kind == "shell" and not self.settings.shell_enabled:
            return (
                "shell actions are disabled on this runtime; an operator enables them with "
                "PARLEY_CUSTOM_ACTIONS_SHELL=true"
            )
        if kind == "code" and not self.settings.code_enabled:
            return (
                "code actions are disabled on this runtime; an operator enables them with "
                "PARLEY_CUSTOM_ACTIONS_CODE=true"
            )
        return None

    async def run(
        self,
        definition: CustomActionDef,
        params: Mapping[str, object],
        setting: Callable[[str], object | None] | None = None,
    ) -> TestResult:
        """``setting``: the agent's settings, for ``{{secret:NAME}}``; their values never reach the
        output (redacted, like literal credential headers)."""
        refusal = self.disabled(definition)
        if refusal is not None:
            return TestResult(False, refusal)
        handler = definition.handler
        limit = self.settings.output_chars
        # A planner's parameter named like a reference must not stand in for the agent's secret.
        values = {k: v for k, v in params.items() if not k.startswith(SECRET_PREFIX)}
        hidden = definition.header_secrets()
        for name in definition.secret_refs():
            value = setting(name) if setting is not None else None
            if value is None:
                return TestResult(
                    False,
                    f"the secret {name} is not set for this agent (its character's secrets or settings)",
                )
            values[SECRET_PREFIX + name] = value
            hidden.append(value if isinstance(value, str) else str(value))
        if isinstance(handler, HttpHandler):
            outcome = await run_http(
                handler, values, self.guard, timeout=self.settings.http_timeout, limit=limit
            )
            ok, output = outcome.ok, outcome.output
        elif isinstance(handler, ShellHandler):
            try:
                ok, output = _process(await run_shell(handler, params, limit=limit), handler.timeout_seconds)
            except CommandNotFound as exc:
                ok, output = False, str(exc)
            except UnicodeError:  # a lone surrogate cannot be an argument
                ok, output = False, "a value cannot be passed to the command: it is not valid text"
        else:
            assert isinstance(handler, CodeHandler)
            ok, output = _process(await run_code(handler, params, limit=limit), handler.timeout_seconds)
        return TestResult(ok, Redactor(hidden).redact(output))


def _process(outcome: ProcessOutcome, timeout: float) -> tuple[bool, str]:
    if outcome.timed_out:
        return False, f"timed out after {timeout:g}s" + (f": {outcome.output}" if outcome.output else "")
    if outcome.returncode != 0:
        return False, f"exit status {outcome.returncode}: {outcome.output}"
    return True, outcome.output


def load_config_file(path: Path) -> list[CustomActionDef]:
    try:
        text = path.read_text()
        data = yaml.safe_load(text)  # JSON is YAML too
    except (OSError, yaml.YAMLError) as exc:
        raise errors.CUSTOM_ACTION_INVALID(
            f"{path.name}: cannot read the custom actions file ({type(exc).__name__})"
        ) from None
    return parse_definitions(data, path.name)
