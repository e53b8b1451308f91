"""The scheduler's error codes (INVALID_ID, INVALID_PAGE and the worker codes are the platform's)."""

from __future__ import annotations

from parley_platform.errors import Catalog, Kind

CATALOG = Catalog("scheduler", "The scheduler: tasks, their schedules, runs and leases.")
define = CATALOG.define

# Requests
TASK_INVALID = define(
    "TASK_INVALID",
    Kind.INVALID_ARGUMENT,
    "A task field is invalid: the worker name, tags, description, values, a required id, the update"
    " mask, a status filter or a worker's service name.",
)
TASK_SCHEDULE_INVALID = define(
    "TASK_SCHEDULE_INVALID",
    Kind.INVALID_ARGUMENT,
    "The task's schedule is invalid: an interval, a time, a limit, the missed-run policy or the cron"
    " expression of its metadata, or a combination they exclude.",
    hint="intervals are positive finite milliseconds; cron is 5 fields in UTC",
)
TASK_BATCH_INVALID = define(
    "TASK_BATCH_INVALID",
    Kind.INVALID_ARGUMENT,
    "A CreateTasks batch is empty, holds more than 1000 tasks, or names one id twice.",
)
INVALID_LIMIT = define(
    "INVALID_LIMIT", Kind.INVALID_ARGUMENT, "RunDueTasks was asked for a limit outside 1 to 1000."
)
TASK_ADAPTIVE_INTERVAL_INVALID = define(
    "TASK_ADAPTIVE_INTERVAL_INVALID",
    Kind.INVALID_ARGUMENT,
    "A worker answered a successful run with a next_interval_ms out of range, or with one for a cron"
    " task; the task keeps its schedule. Not raised: recorded as the task's last_error.",
)

# Tasks
TASK_NOT_FOUND = define(
    "TASK_NOT_FOUND",
    Kind.NOT_FOUND,
    "No task has that id (of that agent, when the request names one).",
    hint="list them with `parley tasks list`",
)
TASK_EXISTS = define(
    "TASK_EXISTS",
    Kind.CONFLICT,
    "A task with the id given already exists; nothing of the request was created.",
    hint="leave id empty to get a new one",
)
TASK_REVISION_CHANGED = define(
    "TASK_REVISION_CHANGED",
    Kind.CONFLICT,
    "The task is not at the revision the update expected, or kept changing while it was updated.",
    hint="read it again and reapply the change",
    retryable=True,
)
TASK_FAILED = define(
    "TASK_FAILED",
    Kind.FAILED_PRECONDITION,
    "The task failed (it ran out of attempts, or its worker is gone); there is nothing to pause.",
    hint="resume it to run it again, or delete it",
)
TASK_NOT_PAUSED = define(
    "TASK_NOT_PAUSED",
    Kind.FAILED_PRECONDITION,
    "The task could not be resumed to run now: its state changed while the resume was applied.",
)
TASK_RUNNING = define(
    "TASK_RUNNING",
    Kind.CONFLICT,
    "ExecuteTask found the task's lease held: a run of it is in progress.",
    hint="wait for the run to finish",
    retryable=True,
)
