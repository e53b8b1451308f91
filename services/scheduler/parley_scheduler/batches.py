"""The runs dispatched together, sent together.

The runs of one claim are dispatched in the same turn of the event loop. Those of one worker name
go to its workers as one request, a ``RunTaskBatch`` of up to ``MAX_BATCH_RUNS`` runs; a worker
runs each on its own and answers on the batch's reply subject as they end (``RunTaskReplies``), so
one slow run holds up no other's outcome. A run dispatched alone goes as a ``RunTaskRequest``, as
it always did. Either way each run has its own future: its ``RunTaskResponse``, or the
``parley.v1.Error`` of a run that could not start; ``NO_RESPONDERS`` or the bus's error when the
request could not be delivered. Bounding the wait is the caller's (the dispatcher's watch).
"""

from __future__ import annotations

import asyncio
from typing import Any

from google.protobuf.message import DecodeError
from nats.aio.msg import Msg

from parley.v1 import common_pb2, scheduler_pb2
from parley_platform import codes
from parley_platform.bus import Inbox
from parley_platform.errors import ParleyError
from parley_platform.permissions import MAX_BATCH_RUNS
from parley_platform.worker import BATCH_HEADER, STATUS

Reply = scheduler_pb2.RunTaskResponse | common_pb2.Error


def _unreadable() -> common_pb2.Error:
    return codes.BAD_REPLY("the worker's reply does not decode").to_proto()


class _Batch:
    """The runs of one worker name dispatched in one turn of the event loop."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.message = scheduler_pb2.RunTaskBatch()
        self.futures: list[asyncio.Future[Reply]] = []
        self._open = 0
        self._close: Any = None

    def add(self) -> tuple[scheduler_pb2.RunTaskRequest, asyncio.Future[Reply]]:
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        future.add_done_callback(self._settled)
        self.futures.append(future)
        self._open += 1
        return self.message.runs.add(), future

    def _settled(self, _: asyncio.Future[Reply]) -> None:
        """A run answered or given up on: once none is left, its replies are not listened for."""
        self._open -= 1
        if self._open == 0 and self._close is not None:
            self._close()

    async def send(self, inbox: Inbox) -> None:
        try:
            if len(self.futures) == 1:
                reply = await inbox.request(self.subject, self.message.runs[0].SerializeToString())
                reply.add_done_callback(self._one)
                self.futures[0].add_done_callback(lambda _: reply.cancel())  # given up: forgotten
                return
            close = await inbox.listen(
                self.subject,
                self.message.SerializeToString(),
                self._on_reply,
                headers={BATCH_HEADER: str(len(self.futures))},
            )
        except ParleyError as exc:
            self._fail(exc)
            return
        except asyncio.CancelledError:
            self._fail(codes.NATS_UNAVAILABLE("the scheduler stopped before the runs were sent"))
            raise
        if self._open == 0:
            close()
        else:
            self._close = close

    def _one(self, reply: asyncio.Future[Msg]) -> None:
        """The reply to a run sent alone."""
        future = self.futures[0]
        if future.done():
            return
        if reply.cancelled():
            future.cancel()
        elif (exc := reply.exception()) is not None:
            future.set_exception(exc)
        else:
            future.set_result(_read_one(reply.result()))

    def _on_reply(self, reply: Msg | ParleyError) -> None:
        if isinstance(reply, ParleyError):
            self._fail(reply)
            return
        if (reply.headers or {}).get(STATUS) == "error":  # the batch itself was refused
            try:
                error = common_pb2.Error.FromString(reply.data)
            except DecodeError:
                error = _unreadable()
            self._answer_all(error)
            return
        try:
            replies = scheduler_pb2.RunTaskReplies.FromString(reply.data)
        except DecodeError:
            self._answer_all(_unreadable())
            return
        for answer in replies.replies:
            if answer.index < len(self.futures):
                future = self.futures[answer.index]
                if not future.done():
                    future.set_result(answer.error if answer.HasField("error") else answer.response)

    def _answer_all(self, reply: Reply) -> None:
        for future in self.futures:
            if not future.done():
                future.set_result(reply)

    def _fail(self, exc: BaseException) -> None:
        for future in self.futures:
            if not future.done():
                future.set_exception(exc)


def _read_one(msg: Msg) -> Reply:
    try:
        if (msg.headers or {}).get(STATUS) == "error":
            return common_pb2.Error.FromString(msg.data)
        return scheduler_pb2.RunTaskResponse.FromString(msg.data)
    except DecodeError:
        return _unreadable()


class RunBatches:
    """Gathers the runs dispatched in one turn of the event loop into a request per worker name."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        self._forming: dict[str, _Batch] = {}
        self._scheduled = False
        self._sending: set[asyncio.Task[None]] = set()

    def add(self, subject: str) -> tuple[scheduler_pb2.RunTaskRequest, asyncio.Future[Reply]]:
        """A run to fill in before the caller next awaits (it is sent when the loop turns), and the
        future of its reply."""
        batch = self._forming.get(subject)
        if batch is None:
            batch = self._forming[subject] = _Batch(subject)
            if not self._scheduled:
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._flush)
        run, future = batch.add()
        if len(batch.futures) == MAX_BATCH_RUNS:  # full: sent as it is (once the caller filled it in)
            del self._forming[subject]
            self._send(batch)
        return run, future

    def _flush(self) -> None:
        self._scheduled = False
        forming, self._forming = self._forming, {}
        for batch in forming.values():
            self._send(batch)

    def _send(self, batch: _Batch) -> None:
        task = asyncio.create_task(batch.send(self.inbox))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
