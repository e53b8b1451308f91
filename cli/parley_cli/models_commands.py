"""`parley models list|usage|budget`: the model gateway's operator side, over gRPC."""

from __future__ import annotations

from typing import Any

import typer

from parley.v1 import common_pb2, model_pb2, model_pb2_grpc

from . import client, common
from .common import Json, Offset, command

app = common.group("models", "The model gateway: models, usage and token budgets.")
call = client.caller("model-gateway", model_pb2_grpc.ModelGatewayStub)


def _type_name(value: int) -> str:
    if not value:
        return "-"
    return model_pb2.ModelType.Name(model_pb2.ModelType.ValueType(value)).removeprefix("MODEL_TYPE_")


@command(app, "list")
async def list_models(json: Json = False) -> None:
    """Which provider and model serve each model type.

    Then each provider's health: circuit, calls in flight and queued, and concurrency limit."""
    reply = await call("ListModels", model_pb2.ListModelsRequest())
    if json:
        common.print_json(reply)
        return
    routes = [[_type_name(r.model_type), r.provider, r.model] for r in reply.routes]
    embedding = f"{reply.embedding_model} ({reply.embedding_dimension} dims)"
    common.table(
        ["MODEL TYPE", "PROVIDER", "MODEL"], [*routes, ["EMBEDDING", reply.embedding_provider, embedding]]
    )
    print()
    common.table(
        ["PROVIDER", "CIRCUIT", "INFLIGHT", "QUEUED", "LIMIT"],
        [[p.name, p.circuit, p.inflight, p.queued, p.concurrency_limit] for p in reply.providers],
    )


@command(app)
async def usage(
    agent: str = typer.Option("", metavar="NAME", help="agent name or id (default: every agent)"),
    offset: Offset = 0,
    all: bool = typer.Option(False, "--all", help="every page, not just the first 100 rows"),
    json: Json = False,
) -> None:
    """The usage ledger: calls and tokens.

    One row per agent, provider, model, model type and kind of call."""
    agent_id = await client.agent_id(agent)
    rows: list[Any] = []
    while True:
        page = common_pb2.PageRequest(limit=100, offset=offset)
        reply = await call("GetUsage", model_pb2.GetUsageRequest(agent_id=agent_id, page=page))
        rows.extend(reply.rows)
        if not all or not reply.page.has_more:
            break
        offset = reply.page.next_offset
    if json:
        common.print_json([common.as_dict(r) for r in rows])
        return
    common.table(
        ["AGENT", "PROVIDER", "MODEL", "TYPE", "KIND", "CALLS", "INPUT", "OUTPUT", "CACHED"],
        [
            [
                r.agent_id or "-",
                r.provider,
                r.model,
                _type_name(r.model_type),
                r.kind,
                r.requests,
                r.usage.input_tokens,
                r.usage.output_tokens,
                r.usage.cached_input_tokens,
            ]
            for r in rows
        ],
        common.next_offset(reply.page),
    )


@command(app)
async def budget(
    agent: str = typer.Option(..., metavar="NAME", help="agent name or id"),
    set: int | None = typer.Option(None, "--set", metavar="TOKENS", help="tokens per window (0 removes it)"),
    window: int = typer.Option(0, metavar="SECONDS", help="the window (default: the gateway's)"),
    json: Json = False,
) -> None:
    """Show an agent's token budget, or set it with --set."""
    agent_id = await client.agent_id(agent)
    if set is not None:
        request = model_pb2.SetBudgetRequest(agent_id=agent_id, limit_tokens=set, window_seconds=window)
        found = await call("SetBudget", request)
    else:
        found = await call("GetBudget", model_pb2.GetBudgetRequest(agent_id=agent_id))
    if json:
        common.print_json(found)
    elif not found.limit_tokens:
        print(f"{agent_id}: no token budget")
    else:
        print(
            f"{agent_id}: {found.spent_tokens} spent + {found.reserved_tokens} reserved of "
            f"{found.limit_tokens} tokens per {found.window_seconds}s window"
        )
