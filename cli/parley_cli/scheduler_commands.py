"""`parley tasks list|show|create|pause|resume|run|delete`: the scheduler's operator commands."""

from __future__ import annotations

import argparse
import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf import json_format

from parley.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from parley_platform.errors import InvalidArgument, NotFound

from . import client

SERVICE = "scheduler"
STATUSES = {"active": 1, "paused": 2, "running": 3, "failed": 4}
OUTCOMES = {
    value: name.removeprefix("TASK_OUTCOME_").lower() for name, value in scheduler_pb2.TaskOutcome.items()
}
DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


@asynccontextmanager
async def _stub() -> AsyncIterator[tuple[scheduler_pb2_grpc.SchedulerStub, client.Metadata]]:
    async with client.service_stub(SERVICE, scheduler_pb2_grpc.SchedulerStub) as pair:
        yield pair


async def _call(method: Any, request: Any, metadata: client.Metadata, timeout: float = 10.0) -> Any:
    return await client.call(method, request, metadata, timeout=timeout, service=SERVICE)


def duration_ms(text: str, option: str) -> float:
    """``500ms``, ``1.5s``, ``5m``, ``2h``, ``1d``; a bare number is seconds."""
    match = DURATION.match(text.strip())
    if not match:
        raise InvalidArgument(f"{option}: {text!r} is not a duration like 500ms, 30s, 5m, 2h")
    return float(match.group(1)) * UNIT_MS[match.group(2) or "s"]


def due_time(text: str) -> datetime:
    """An ISO 8601 time (UTC when no zone is given), or ``+DURATION`` from now."""
    if text.startswith("+"):
        return datetime.now(UTC) + timedelta(milliseconds=duration_ms(text[1:], "--due"))
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidArgument(f"--due: {text!r} is not an ISO time or +DURATION") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


async def agent_id(ref: str) -> str:
    """An agent id as given, or the id of the agent with that name (asked of the runtime)."""
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        return (await client.resolve_agent(ref)).id


def _when(stamp: Any, present: bool) -> str:
    return stamp.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%d %H:%M:%S") if present else "-"


def _status(task: scheduler_pb2.Task) -> str:
    name = scheduler_pb2.TaskStatus.Name(task.status).removeprefix("TASK_STATUS_").lower()
    if task.status == scheduler_pb2.TASK_STATUS_PAUSED and task.pause_reason:
        name += f" ({task.pause_reason})"
    return name


def _schedule(task: scheduler_pb2.Task) -> str:
    meta = task.metadata
    if meta.cron:
        return f"cron {meta.cron}"
    if meta.HasField("update_interval_ms"):
        return f"every {meta.update_interval_ms / 1000:g}s"
    return "once"


def _print_json(message: Any) -> None:
    print(json_format.MessageToJson(message, indent=2, preserving_proto_field_name=True))


async def cmd_list(args: argparse.Namespace) -> int:
    request = scheduler_pb2.ListTasksRequest(
        tags=args.tag or [],
        name=args.name or "",
        status=STATUSES.get(args.status or "", 0),  # type: ignore[arg-type]
        page=common_pb2.PageRequest(limit=args.limit, offset=args.offset),
    )
    if args.agent:
        request.agent_id = await agent_id(args.agent)
    async with _stub() as (stub, metadata):
        reply = await _call(stub.ListTasks, request, metadata)
    if args.json:
        _print_json(reply)
        return 0
    print(f"{'ID':<36}  {'NAME':<20} {'STATUS':<22} {'SCHEDULE':<18} {'NEXT RUN':<19}  FAILURES")
    for task in reply.tasks:
        print(
            f"{task.id:<36}  {task.name[:20]:<20} {_status(task):<22} {_schedule(task)[:18]:<18} "
            f"{_when(task.next_run_at, task.HasField('next_run_at')):<19}  {task.failure_count}"
        )
    if reply.page.has_more:
        print(f"(more: --offset {reply.page.next_offset})")
    return 0


async def cmd_show(args: argparse.Namespace) -> int:
    async with _stub() as (stub, metadata):
        reply = await _call(stub.GetTaskStatus, scheduler_pb2.GetTaskStatusRequest(id=args.id), metadata)
    if not reply.HasField("task"):
        raise NotFound(f"no task {args.id}", code="TASK_NOT_FOUND", hint="list them with `parley tasks list`")
    if args.json:
        _print_json(reply)
        return 0
    task = reply.task
    rows = [
        ("id", task.id),
        ("name", task.name),
        ("agent", task.agent_id),
        ("description", task.description or "-"),
        ("tags", ", ".join(task.tags) or "-"),
        ("status", _status(task) + (", executing" if reply.executing else "")),
        ("schedule", _schedule(task)),
        ("next run", _when(task.next_run_at, task.HasField("next_run_at"))),
        ("last run", _when(task.last_run_at, task.HasField("last_run_at"))),
        ("runs", str(task.run_count)),
        ("failures", str(task.failure_count)),
        ("last error", task.last_error or "-"),
        ("attempt", str(task.attempt)),
        ("orphaned", "yes (no worker)" if task.orphaned_no_worker else "no"),
    ]
    if task.metadata.HasField("values"):
        rows.append(("values", json.dumps(json_format.MessageToDict(task.metadata.values))))
    for attempt in reply.uncertain_attempts:
        rows.append(("uncertain", f"attempt {attempt.attempt} by {attempt.owner}"))
    for key, value in rows:
        print(f"{key + ':':<13}{value}")
    return 0


async def cmd_create(args: argparse.Namespace) -> int:
    tags = ([] if args.no_queue else ["queue"]) + (["repeat"] if args.repeat else []) + (args.tag or [])
    tags = list(dict.fromkeys(tags))
    spec = scheduler_pb2.TaskSpec(
        agent_id=await agent_id(args.agent), name=args.name, description=args.description or "", tags=tags
    )
    meta = spec.metadata
    if args.interval:
        meta.update_interval_ms = duration_ms(args.interval, "--interval")
    if args.cron:
        meta.cron = args.cron
    if args.max_failures is not None:
        meta.max_failures = args.max_failures
    if args.timeout:
        meta.timeout_ms = duration_ms(args.timeout, "--timeout")
    if args.due:
        spec.due_at.FromDatetime(due_time(args.due))
    if args.values:
        try:
            values = json.loads(args.values)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"--values is not JSON: {exc.msg}") from None
        if not isinstance(values, dict):
            raise InvalidArgument("--values must be a JSON object")
        meta.values.update(values)
    async with _stub() as (stub, metadata):
        reply = await _call(stub.CreateTask, scheduler_pb2.CreateTaskRequest(task=spec), metadata)
    if args.json:
        _print_json(reply.task)
    else:
        print(f"created {reply.task.id}  {reply.task.name}  next run {_when(reply.task.next_run_at, True)}")
    return 0


async def cmd_pause(args: argparse.Namespace) -> int:
    async with _stub() as (stub, metadata):
        reply = await _call(stub.PauseTask, scheduler_pb2.PauseTaskRequest(id=args.id), metadata)
    print(f"{reply.task.id}  {_status(reply.task)}")
    return 0


async def cmd_resume(args: argparse.Namespace) -> int:
    request = scheduler_pb2.ResumeTaskRequest(id=args.id, run_immediately=args.now)
    async with _stub() as (stub, metadata):
        reply = await _call(stub.ResumeTask, request, metadata)
    print(f"{reply.task.id}  {_status(reply.task)}  next run {_when(reply.task.next_run_at, True)}")
    return 0


async def cmd_run(args: argparse.Namespace) -> int:
    async with _stub() as (stub, metadata):
        reply = await _call(
            stub.ExecuteTask, scheduler_pb2.ExecuteTaskRequest(id=args.id), metadata, timeout=args.timeout
        )
    run = reply.run
    outcome = OUTCOMES.get(run.outcome, "unknown")
    line = f"{run.task_id}  {outcome}  attempt {run.attempt}  {run.duration_ms:.1f} ms"
    if run.deleted:
        line += "  (done, removed)"
    print(line + (f"\n  error: {run.error}" if run.error else ""))
    return 0 if run.outcome == scheduler_pb2.TASK_OUTCOME_SUCCEEDED else 1


async def cmd_delete(args: argparse.Namespace) -> int:
    async with _stub() as (stub, metadata):
        reply = await _call(stub.DeleteTask, scheduler_pb2.DeleteTaskRequest(id=args.id), metadata)
    print(f"deleted {reply.task.id}  {reply.task.name}")
    return 0


def register(subparsers: Any) -> None:
    tasks = subparsers.add_parser("tasks", help="scheduled tasks (the scheduler service)")
    sub = tasks.add_subparsers(dest="tasks_command", required=True)

    p = sub.add_parser("list", help="list tasks, oldest first")
    p.add_argument("--agent", help="only this agent (id or name)")
    p.add_argument("--tag", action="append", help="only tasks with this tag (repeatable)")
    p.add_argument("--status", choices=sorted(STATUSES))
    p.add_argument("--name", help="only this worker name")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(coro=cmd_list)

    p = sub.add_parser("show", help="one task: status, schedule, last error, uncertain attempts")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(coro=cmd_show)

    p = sub.add_parser("create", help="create a task for a worker")
    p.add_argument("name", help="the worker name")
    p.add_argument("--agent", default="default", help="agent id or name (default: default)")
    p.add_argument("--description")
    p.add_argument("--tag", action="append", help="an extra tag (repeatable)")
    p.add_argument("--repeat", action="store_true", help="recurring (needs --interval or --cron)")
    p.add_argument("--interval", help="repeat interval: 500ms, 30s, 5m, 2h")
    p.add_argument("--cron", help="repeat on a 5-field cron expression, UTC")
    p.add_argument("--due", help="first run: an ISO time (UTC) or +DURATION")
    p.add_argument("--max-failures", type=float, dest="max_failures", help="pause after this many; 0 never")
    p.add_argument("--timeout", help="deadline of one run, e.g. 30s")
    p.add_argument("--values", help="a JSON object passed to the worker")
    p.add_argument("--no-queue", action="store_true", help="not polled: runs only with `parley tasks run`")
    p.add_argument("--json", action="store_true")
    p.set_defaults(coro=cmd_create)

    p = sub.add_parser("pause", help="pause a task")
    p.add_argument("id")
    p.set_defaults(coro=cmd_pause)

    p = sub.add_parser("resume", help="resume a paused or failed task")
    p.add_argument("id")
    p.add_argument("--now", action="store_true", help="and run it at once")
    p.set_defaults(coro=cmd_resume)

    p = sub.add_parser("run", help="run a task now, whatever its schedule, and wait for it")
    p.add_argument("id")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the run")
    p.set_defaults(coro=cmd_run)

    p = sub.add_parser("delete", help="delete a task")
    p.add_argument("id")
    p.set_defaults(coro=cmd_delete)
