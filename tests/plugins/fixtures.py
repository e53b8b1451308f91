"""Actions and a provider for the runtime's turn-loop tests. Each handler appends a line to the
file named by the runtime process's FIXTURE_LOG variable, so a test can count how often it ran."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from parley_runtime.sdk import (
    Action,
    ActionResult,
    Callback,
    Capability,
    Content,
    Parameter,
    Plugin,
    Provider,
    ProviderResult,
    Tag,
    TurnContext,
)


def _log(line: str) -> None:
    path = os.environ.get("FIXTURE_LOG")
    if path:
        with Path(path).open("a") as handle:
            handle.write(line + "\n")


async def _private(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    _log(f"PRIVATE_OP {ctx.message.id}")
    return ActionResult(True)


async def _admin(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    _log(f"ADMIN_OP {ctx.message.id} {ctx.role}")
    return ActionResult(True, text="admin op ran")


async def _flaky(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    _log(f"FLAKY_OP {ctx.message.id}")
    raise RuntimeError("the flaky op failed")


async def _slow_effect(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    _log(f"SLOW_EFFECT start {ctx.message.id}")
    await asyncio.sleep(float(os.environ.get("FIXTURE_EFFECT_SECONDS", "0")))
    _log(f"SLOW_EFFECT end {ctx.message.id}")
    return ActionResult(True, text="effect applied")


async def _forecast(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    _log(f"FORECAST {params['city']}")
    await callback(Content(text=f"Sunny in {params['city']}.", actions=("FORECAST",)))
    return ActionResult(True, values={"city": params["city"]})


async def _attach(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    report = {
        "id": "r1",
        "url": "https://example.com/report.pdf",
        "title": "Report",
        "contentType": "application/pdf",
    }
    await callback(Content(text="Here is the report.", actions=("ATTACH_OP",), attachments=(report,)))
    return ActionResult(True)


async def _pay(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    _log(f"PAY_OP {params['invoice']}")
    return ActionResult(True, text=f"paid {params['invoice']}")


async def _secret_word(ctx: TurnContext) -> ProviderResult:
    return ProviderResult("# Secret\nthe secret word is kiwi")


fixtures_plugin = Plugin(
    name="fixtures",
    actions=(
        Action(
            "PRIVATE_OP",
            "only for autonomous turns",
            _private,
            private=True,
            tags=frozenset({Tag.IDEMPOTENT}),
        ),
        Action(
            "ADMIN_OP",
            "only for admins",
            _admin,
            roles=frozenset({"OWNER", "ADMIN"}),
            tags=frozenset({Tag.IDEMPOTENT}),
        ),
        Action("FLAKY_OP", "always raises", _flaky, tags=frozenset({Tag.IDEMPOTENT})),
        Action("SLOW_EFFECT", "a non-idempotent effect that takes a while", _slow_effect),
        Action("ATTACH_OP", "attaches a report to the reply", _attach, tags=frozenset({Tag.IDEMPOTENT})),
        Action(
            "PAY_OP",
            "pays an invoice through the agent's payments account",
            _pay,
            capability=Capability("payments.transfer", "create", "R3"),
            parameters=(Parameter("invoice", "the invoice id", required=True, schema={"type": "string"}),),
        ),
        Action(
            "PAY_CONFIRMED",
            "pays an invoice once a person confirms",
            _pay,
            tags=frozenset({Tag.CONFIRM}),
            capability=Capability("payments.transfer", "create", "R3"),
            parameters=(Parameter("invoice", "the invoice id", required=True, schema={"type": "string"}),),
        ),
        Action(
            "FORECAST",
            "the weather forecast for a city",
            _forecast,
            tags=frozenset({Tag.IDEMPOTENT}),
            parameters=(
                Parameter("city", "the city", required=True, schema={"type": "string", "minLength": 2}),
            ),
        ),
    ),
    providers=(Provider("SECRET_WORD", _secret_word, "a secret word", dynamic=True),),
)
