"""`parley autonomy on|off|status AGENT`: the agent thinking and acting on its own, over gRPC."""

from __future__ import annotations

from typing import Annotated

import typer

from parley.v1 import runtime_pb2

from . import client, common
from .common import Json, command, when

app = common.group(
    "autonomy",
    """An agent acting on its own: every AUTONOMY_INTERVAL_MS it thinks (AUTONOMY_MODEL_SIZE model)
    and may act, in its own autonomy room; `parley turns` lists those turns as autonomous.""",
)

AgentArg = Annotated[str, typer.Argument(metavar="AGENT", help="the agent's name or id")]


def _show(status: runtime_pb2.AutonomyStatus, json: bool) -> None:
    last = when(status.last_turn_at) if status.HasField("last_turn_at") else "-"
    if json:
        common.print_json(
            {
                "agent_id": status.agent_id,
                "enabled": status.enabled,
                "decided_by": status.decided_by,
                "interval_ms": status.interval_ms,
                "model_size": status.model_size,
                "generation": status.generation,
                "turns": status.turns,
                "last_turn_at": last,
            }
        )
        return
    print(
        f"autonomy {'on' if status.enabled else 'off'} (set by the {status.decided_by}) for agent"
        f" {status.agent_id}: every {status.interval_ms} ms, {status.model_size} model;"
        f" {status.turns} autonomous turn(s), last {last}"
    )


@command(app)
async def on(agent: AgentArg, json: Json = False) -> None:
    """Switch the agent's autonomy on (on every replica, within a moment)."""
    request = runtime_pb2.SetAutonomyRequest(agent_id=agent, enabled=True)
    _show(await client.runtime("SetAutonomy", request), json)


@command(app)
async def off(agent: AgentArg, json: Json = False) -> None:
    """Switch it off: no think after the current one."""
    request = runtime_pb2.SetAutonomyRequest(agent_id=agent, enabled=False)
    _show(await client.runtime("SetAutonomy", request), json)


@command(app)
async def status(agent: AgentArg, json: Json = False) -> None:
    """Whether the agent thinks on its own, how often, with which model, and how many turns so far."""
    _show(await client.runtime("GetAutonomy", runtime_pb2.GetAutonomyRequest(agent_id=agent)), json)
