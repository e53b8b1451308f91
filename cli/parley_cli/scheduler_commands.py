"""`parley tasks list|show|create|pause|resume|run|delete`: the scheduler's operator commands."""

from __future__ import annotations

import json as jsonlib
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

import typer

from parley.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from parley_platform.errors import InvalidArgument, NotFound

from . import client, common
from .common import Json, Limit, Offset, command

app = common.group("tasks", "Scheduled tasks (the scheduler service).")
call = client.caller("scheduler", scheduler_pb2_grpc.SchedulerStub)

DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
TaskId = Annotated[str, typer.Argument(metavar="TASK_ID", help="the task's id")]
OUTCOMES = {
    value: name.removeprefix("TASK_OUTCOME_").lower() for name, value in scheduler_pb2.TaskOutcome.items()
}


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


@command(app, "list")
async def list_tasks(
    agent: str = typer.Option("", metavar="NAME", help="only this agent's (name or id)"),
    tag: list[str] | None = typer.Option(None, metavar="TAG", help="only tasks with this tag (repeatable)"),
    status: Literal["active", "failed", "paused", "running"] | None = typer.Option(
        None, help="only tasks in this state"
    ),
    name: str = typer.Option("", metavar="WORKER", help="only this worker name"),
    limit: Limit = 50,
    offset: Offset = 0,
    json: Json = False,
) -> None:
    """Tasks, oldest first: status, schedule, next run."""
    request = scheduler_pb2.ListTasksRequest(
        agent_id=await client.agent_id(agent),
        tags=tag or [],
        name=name,
        status=scheduler_pb2.TaskStatus.Value(f"TASK_STATUS_{(status or 'unspecified').upper()}"),
        page=common_pb2.PageRequest(limit=limit, offset=offset),
    )
    reply = await call("ListTasks", request)
    if json:
        common.print_json(reply)
        return
    common.table(
        ["ID", "NAME", "STATUS", "SCHEDULE", "NEXT RUN", "FAILURES"],
        [
            [t.id, t.name, _status(t), _schedule(t), common.when(t.next_run_at), t.failure_count]
            for t in reply.tasks
        ],
        common.next_offset(reply.page),
    )


@command(app)
async def show(id: TaskId, json: Json = False) -> None:
    """One task, with its last error and uncertain attempts."""
    reply = await call("GetTaskStatus", scheduler_pb2.GetTaskStatusRequest(id=id))
    if not reply.HasField("task"):
        raise NotFound(f"no task {id}", code="TASK_NOT_FOUND", hint="list them with `parley tasks list`")
    if json:
        common.print_json(reply)
        return
    task = reply.task
    rows = [
        ("id", task.id),
        ("name", task.name),
        ("agent", task.agent_id),
        ("description", task.description or "-"),
        ("tags", ", ".join(task.tags) or "-"),
        ("status", _status(task) + (", executing" if reply.executing else "")),
        ("schedule", _schedule(task)),
        ("next run", common.when(task.next_run_at)),
        ("last run", common.when(task.last_run_at)),
        ("runs", str(task.run_count)),
        ("failures", str(task.failure_count)),
        ("last error", task.last_error or "-"),
        ("attempt", str(task.attempt)),
        ("orphaned", "yes (no worker)" if task.orphaned_no_worker else "no"),
    ]
    if task.metadata.HasField("values"):
        rows.append(("values", jsonlib.dumps(common.as_dict(task.metadata.values))))
    rows += [("uncertain", f"attempt {a.attempt} by {a.owner}") for a in reply.uncertain_attempts]
    for key, value in rows:
        print(f"{key + ':':<13}{value}")


@command(app)
async def create(
    name: str = typer.Argument(..., metavar="WORKER", help="the worker name"),
    agent: str = typer.Option("default", metavar="NAME", help="agent name or id"),
    description: str = typer.Option("", metavar="TEXT", help="what the task is for"),
    tag: list[str] | None = typer.Option(None, metavar="TAG", help="an extra tag (repeatable)"),
    repeat: bool = typer.Option(False, "--repeat", help="recurring (needs --interval or --cron)"),
    interval: str = typer.Option("", metavar="DURATION", help="repeat every 500ms, 30s, 5m, 2h..."),
    cron: str = typer.Option("", metavar="EXPR", help="repeat on a 5-field cron expression, UTC"),
    due: str = typer.Option("", metavar="WHEN", help="first run: an ISO time (UTC) or +DURATION"),
    max_failures: float | None = typer.Option(None, metavar="N", help="pause after this many; 0 never"),
    timeout: str = typer.Option("", metavar="DURATION", help="deadline of one run, e.g. 30s"),
    values: str = typer.Option("", metavar="JSON", help="a JSON object passed to the worker"),
    no_queue: bool = typer.Option(False, "--no-queue", help="not polled: runs only with `parley tasks run`"),
    json: Json = False,
) -> None:
    """Create a task for a worker.

    It runs once (at --due, or at once), or repeats with --repeat and --interval or --cron."""
    tags = list(
        dict.fromkeys([*([] if no_queue else ["queue"]), *(["repeat"] if repeat else []), *(tag or [])])
    )
    spec = scheduler_pb2.TaskSpec(name=name, description=description, tags=tags)
    meta = spec.metadata
    if interval:
        meta.update_interval_ms = duration_ms(interval, "--interval")
    if cron:
        meta.cron = cron
    if max_failures is not None:
        meta.max_failures = max_failures
    if timeout:
        meta.timeout_ms = duration_ms(timeout, "--timeout")
    if due:
        spec.due_at.FromDatetime(due_time(due))
    if values:
        try:
            parsed = jsonlib.loads(values)
        except jsonlib.JSONDecodeError as exc:
            raise InvalidArgument(f"--values is not JSON: {exc.msg}") from None
        if not isinstance(parsed, dict):
            raise InvalidArgument("--values must be a JSON object")
        meta.values.update(parsed)
    spec.agent_id = await client.agent_id(agent)
    task = (await call("CreateTask", scheduler_pb2.CreateTaskRequest(task=spec))).task
    if json:
        common.print_json(task)
    else:
        print(f"created {task.id}  {task.name}  next run {common.when(task.next_run_at)}")


@command(app)
async def pause(id: TaskId) -> None:
    """Pause a task: it does not run until resumed."""
    task = (await call("PauseTask", scheduler_pb2.PauseTaskRequest(id=id))).task
    print(f"{task.id}  {_status(task)}")


@command(app)
async def resume(id: TaskId, now: bool = typer.Option(False, "--now", help="and run it at once")) -> None:
    """Resume a paused or failed task."""
    task = (await call("ResumeTask", scheduler_pb2.ResumeTaskRequest(id=id, run_immediately=now))).task
    print(f"{task.id}  {_status(task)}  next run {common.when(task.next_run_at)}")


@command(app)
async def run(
    id: TaskId,
    timeout: float = typer.Option(300.0, metavar="SECONDS", help="how long to wait for the run"),
) -> int:
    """Run a task now, whatever its schedule, and wait.

    Exit code 1 unless the run succeeds."""
    run = (await call("ExecuteTask", scheduler_pb2.ExecuteTaskRequest(id=id), timeout=timeout)).run
    outcome = OUTCOMES.get(run.outcome, "unknown")
    line = f"{run.task_id}  {outcome}  attempt {run.attempt}  {run.duration_ms:.1f} ms"
    if run.deleted:
        line += "  (done, removed)"
    print(line + (f"\n  error: {run.error}" if run.error else ""))
    return 0 if run.outcome == scheduler_pb2.TASK_OUTCOME_SUCCEEDED else 1


@command(app)
async def delete(id: TaskId) -> None:
    """Delete a task."""
    task = (await call("DeleteTask", scheduler_pb2.DeleteTaskRequest(id=id))).task
    print(f"deleted {task.id}  {task.name}")
