"""`parley models list|usage|budget`: the model gateway's operator side, over gRPC."""

from __future__ import annotations

import argparse
import json
import uuid
from typing import Any

from google.protobuf.json_format import MessageToDict

from parley.v1 import common_pb2, model_pb2, model_pb2_grpc

from . import client

SERVICE = "model-gateway"


async def _call(method_name: str, request: Any) -> Any:
    async with client.service_stub(SERVICE, model_pb2_grpc.ModelGatewayStub) as (stub, metadata):
        return await client.call(getattr(stub, method_name), request, metadata, service=SERVICE)


async def _agent_id(ref: str) -> str:
    """An agent id as given (a UUID), else the id of the agent with that name (asked of the runtime)."""
    if not ref:
        return ""
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        return (await client.resolve_agent(ref)).id


def _type_name(value: int) -> str:
    return (
        model_pb2.ModelType.Name(model_pb2.ModelType.ValueType(value)).removeprefix("MODEL_TYPE_")
        if value
        else "-"
    )


async def cmd_list(args: argparse.Namespace) -> int:
    reply = await _call("ListModels", model_pb2.ListModelsRequest())
    if args.json:
        print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2))
        return 0
    print(f"{'MODEL TYPE':<14} {'PROVIDER':<10} MODEL")
    for route in reply.routes:
        print(f"{_type_name(route.model_type):<14} {route.provider:<10} {route.model}")
    embedding = f"{reply.embedding_model} ({reply.embedding_dimension} dims)"
    print(f"{'EMBEDDING':<14} {reply.embedding_provider:<10} {embedding}")
    print()
    print(f"{'PROVIDER':<10} {'CIRCUIT':<10} {'INFLIGHT':>8} {'QUEUED':>7} {'LIMIT':>6}")
    for p in reply.providers:
        print(f"{p.name:<10} {p.circuit:<10} {p.inflight:>8} {p.queued:>7} {p.concurrency_limit:>6}")
    return 0


async def cmd_usage(args: argparse.Namespace) -> int:
    agent_id = await _agent_id(args.agent)
    rows: list[Any] = []
    offset = args.offset
    while True:
        reply = await _call(
            "GetUsage",
            model_pb2.GetUsageRequest(
                agent_id=agent_id, page=common_pb2.PageRequest(limit=100, offset=offset)
            ),
        )
        rows.extend(reply.rows)
        if not args.all or not reply.page.has_more:
            break
        offset = reply.page.next_offset
    if args.json:
        print(json.dumps([MessageToDict(r, preserving_proto_field_name=True) for r in rows], indent=2))
        return 0
    header = f"{'AGENT':<36} {'PROVIDER':<10} {'MODEL':<28} {'TYPE':<12} {'KIND':<8}"
    print(f"{header} {'CALLS':>7} {'INPUT':>9} {'OUTPUT':>9} {'CACHED':>9}")
    for r in rows:
        print(
            f"{r.agent_id or '-':<36} {r.provider:<10} {r.model[:28]:<28} "
            f"{_type_name(r.model_type):<12} {r.kind:<8} {r.requests:>7} {r.usage.input_tokens:>9} "
            f"{r.usage.output_tokens:>9} {r.usage.cached_input_tokens:>9}"
        )
    if not rows:
        print("(no usage yet)")
    return 0


async def cmd_budget(args: argparse.Namespace) -> int:
    agent_id = await _agent_id(args.agent)
    if args.set is not None:
        budget = await _call(
            "SetBudget",
            model_pb2.SetBudgetRequest(agent_id=agent_id, limit_tokens=args.set, window_seconds=args.window),
        )
    else:
        budget = await _call("GetBudget", model_pb2.GetBudgetRequest(agent_id=agent_id))
    if args.json:
        print(json.dumps(MessageToDict(budget, preserving_proto_field_name=True), indent=2))
    elif not budget.limit_tokens:
        print(f"{agent_id}: no token budget")
    else:
        print(
            f"{agent_id}: {budget.spent_tokens} spent + {budget.reserved_tokens} reserved of "
            f"{budget.limit_tokens} tokens per {budget.window_seconds}s window"
        )
    return 0


def register(subparsers: Any) -> None:
    models = subparsers.add_parser("models", help="the model gateway: models, usage, budgets")
    sub = models.add_subparsers(dest="models_command", required=True)

    p = sub.add_parser("list", help="the provider and model behind each model type, and provider health")
    p.add_argument("--json", action="store_true")
    p.set_defaults(coro=cmd_list)

    p = sub.add_parser("usage", help="the usage ledger: calls and tokens per agent, provider and model")
    p.add_argument("--agent", default="", help="agent name or id (default: every agent)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--all", action="store_true", help="every page, not just the first 100 rows")
    p.add_argument("--json", action="store_true")
    p.set_defaults(coro=cmd_usage)

    p = sub.add_parser("budget", help="show or set an agent's token budget")
    p.add_argument("--agent", required=True, help="agent name or id")
    p.add_argument("--set", type=int, help="tokens per window (0 removes the budget)")
    p.add_argument("--window", type=int, default=0, help="window in seconds (default: the gateway's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(coro=cmd_budget)
