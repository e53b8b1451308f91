"""Actions tagged ``confirm`` wait for a person: the runtime and authz as real processes.

LAUNCH_ROCKET (tests/plugins/effects.py) logs each run of its handler to ``public.effect_log``
through a connection of its own: the ground truth of how often it ran. Two runtime replicas
share authz's tool-call events, so "runs once" is proven across processes, not assumed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psycopg
import pytest
import yaml
from plugins.effects import EFFECT_LOG_DDL
from test_runtime_scale import agent_id, effects_characters, python_path, turn_id

from parley.v1 import authz_pb2, authz_pb2_grpc, runtime_pb2
from parley_platform.bus import Bus
from parley_platform.testing import eventually
from support import Suite, inbound, publish_inbound, replies_to, stream_messages

AGENT = agent_id("effects")
PARLEY = str(Path(sys.executable).parent / "parley")


class Confirming:
    def __init__(self, suite: Suite, bus: Bus, authz: authz_pb2_grpc.AuthzStub, authz_addr: str) -> None:
        self.suite = suite
        self.bus = bus
        self.authz = authz
        self.authz_addr = authz_addr
        self.metadata = (("authorization", f"Bearer {suite.env.token}"),)
        self.channel = f"confirm-{uuid.uuid4().hex[:8]}"

    def message(self, text: str, sender: str = "alice") -> runtime_pb2.InboundMessage:
        return inbound(text, agent_id=AGENT, channel=self.channel, sender=sender, source="confirm")

    async def send(
        self, text: str, sender: str = "alice", metadata: dict[str, str] | None = None
    ) -> runtime_pb2.InboundMessage:
        message = self.message(text, sender)
        message.metadata.update(metadata or {})
        await publish_inbound(self.bus, message)
        return message

    async def replies(self, message: runtime_pb2.InboundMessage, count: int = 1) -> list[str]:
        async def enough() -> list[runtime_pb2.OutboundMessage] | None:
            replies = await replies_to(self.bus, message)
            return replies if len(replies) >= count else None

        return [
            r.text for r in await eventually(enough, timeout=30, what=f"{count} replies to {message.text!r}")
        ]

    async def tool_call(self, call_id: str) -> authz_pb2.ToolCall:
        return await self.authz.GetToolCall(
            authz_pb2.GetToolCallRequest(agent_id=AGENT, tool_call_id=call_id),
            metadata=self.metadata,
            timeout=10,
        )

    async def continuation(self, proposal: runtime_pb2.InboundMessage) -> list[str]:
        """The agent's own follow-up once every call of the proposing reply is settled."""
        prompt_id = await self.prompt_id(proposal)
        follow_up = runtime_pb2.InboundMessage(source="confirm", message_id=f"confirmations:{prompt_id}")
        follow_up.agent_id = AGENT
        return await self.replies(follow_up)

    async def prompt_id(self, proposal: runtime_pb2.InboundMessage) -> str:
        for reply in await replies_to(self.bus, proposal):
            if reply.text.startswith("Before I go ahead"):
                return reply.response_id
        raise AssertionError("no confirmation prompt")

    async def decide(self, call_id: str, *, approve: bool, reason: str = "") -> None:
        await self.authz.Decide(
            authz_pb2.DecideRequest(
                agent_id=AGENT,
                tool_call_id=call_id,
                decision=authz_pb2.TOOL_DECISION_APPROVE if approve else authz_pb2.TOOL_DECISION_DENY,
                reason=reason,
                decided_by="e2e",
            ),
            metadata=self.metadata,
            timeout=10,
        )

    async def follow_ups(self, proposal: runtime_pb2.InboundMessage) -> list[runtime_pb2.InboundMessage]:
        """The continuation messages published for the proposing reply (on the INBOUND stream)."""
        wanted = f"confirmations:{await self.prompt_id(proposal)}"
        messages = [
            runtime_pb2.InboundMessage.FromString(m.data)
            for m in await stream_messages(self.bus, self.bus.subjects.self_inbound(AGENT))
        ]
        return [m for m in messages if m.message_id == wanted]

    def effects(self, message: runtime_pb2.InboundMessage) -> int:
        with psycopg.connect(self.suite.env.database_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM public.effect_log WHERE turn_id = %s",
                (turn_id(AGENT, "confirm", message.message_id),),
            ).fetchone()
        assert row is not None
        return int(row[0])

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": "/usr/bin:/bin",
            "PARLEY_NATS_URL": self.suite.env.nats_url,
            "PARLEY_NAMESPACE": self.suite.namespace,
            "PARLEY_OPERATOR_TOKEN": self.suite.env.token,
            "PARLEY_AUTHZ_ADDR": self.authz_addr,
            "PARLEY_RUNTIME_ADDR": f"127.0.0.1:{self.suite.runtimes[-1].grpc_port}",  # the newest replica
        }
        return subprocess.run(
            [PARLEY, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )


def call_id_of(proposal: runtime_pb2.InboundMessage) -> str:
    # The first action of the plan (LAUNCH_ROCKET,REPLY) is the one that waits.
    return f"{turn_id(AGENT, 'confirm', proposal.message_id)}:0"


@pytest.fixture
async def confirming(isolated_suite: Suite, tmp_path: Path) -> AsyncIterator[Confirming]:
    database_url = isolated_suite.env.database_url
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(EFFECT_LOG_DDL)
    characters = effects_characters(tmp_path / "characters", database_url, 0)
    # `hasty`: the effects agent whose RECORD_EFFECT waits for confirmation by policy (the action
    # itself is not tagged), and whose confirmations expire after a second.
    hasty = yaml.safe_load((characters / "effects.yaml").read_text())
    hasty["name"] = "hasty"
    hasty["settings"] = {
        **hasty["settings"],
        "CONFIRM_ACTIONS": "RECORD_EFFECT",
        "CONFIRMATION_TTL_SECONDS": 1,
    }
    (characters / "hasty.yaml").write_text(yaml.safe_dump(hasty))
    runtime_env = {"PARLEY_CHARACTERS_DIR": str(characters), "PYTHONPATH": python_path()}
    suite = await isolated_suite.start(runtimes=2, **runtime_env)
    authz = await suite.add_service("parley_authz", "AUTHZ", PARLEY_AUTHZ_SWEEP_INTERVAL_SECONDS="0.2")
    addr = f"127.0.0.1:{authz.grpc_port}"
    bus = await suite.connect()
    channel = grpc.aio.insecure_channel(addr)
    try:
        yield Confirming(suite, bus, authz_pb2_grpc.AuthzStub(channel), addr)
    finally:
        await channel.close()
        await bus.close()


async def test_operator_approval_runs_the_action_once_and_the_conversation_continues(
    confirming: Confirming,
) -> None:
    proposal = await confirming.send("please launch")
    replies = await confirming.replies(proposal, 2)
    assert replies[0] == "I will launch once you confirm."
    call_id = call_id_of(proposal)
    assert replies[1].startswith("Before I go ahead I need your confirmation:\n1. LAUNCH_ROCKET")
    assert call_id in replies[1]
    pending = await confirming.tool_call(call_id)
    assert pending.status == authz_pb2.TOOL_CALL_STATUS_PENDING
    assert pending.tool == "LAUNCH_ROCKET"
    assert '"target": "moon"' in pending.summary
    assert confirming.effects(proposal) == 0, "ran before anyone approved it"

    listed = confirming.cli("approvals", "list", "--agent", "effects")
    assert listed.returncode == 0, listed.stderr
    assert call_id in listed.stdout
    approved = confirming.cli("approvals", "approve", call_id, "--agent", "effects")
    assert approved.returncode == 0, approved.stderr

    assert await confirming.continuation(proposal) == ["All settled."]
    settled = await confirming.tool_call(call_id)
    assert settled.status == authz_pb2.TOOL_CALL_STATUS_SETTLED
    assert settled.outcome == authz_pb2.TOOL_OUTCOME_SUCCESS
    assert settled.settled_by == "runtime"
    assert "effect recorded" in settled.result
    assert confirming.effects(proposal) == 1
    [follow_up] = await confirming.follow_ups(proposal)
    # A continuation, not an autonomous turn (issue 12): on the runtime's own subject, marked as such.
    assert follow_up.metadata["parley_origin"] == "continuation"
    assert follow_up.text == (
        "The actions waiting for confirmation are finished:\n1. LAUNCH_ROCKET: done - effect recorded"
    )


async def test_a_confirm_tagged_action_claimed_autonomous_by_a_connector_is_still_asked_for(
    confirming: Confirming,
) -> None:
    """Metadata on a connector's subject cannot make a turn autonomous (issue 12): the action waits."""
    proposal = await confirming.send(
        "please launch", metadata={"is_autonomous": "true", "parley_origin": "autonomous"}
    )
    replies = await confirming.replies(proposal, 2)
    assert replies[1].startswith("Before I go ahead I need your confirmation:\n1. LAUNCH_ROCKET")
    pending = await confirming.tool_call(call_id_of(proposal))
    assert pending.status == authz_pb2.TOOL_CALL_STATUS_PENDING
    assert confirming.effects(proposal) == 0, "ran without a confirmation"


async def test_the_conversation_continues_once_when_every_call_of_the_message_is_settled(
    confirming: Confirming,
) -> None:
    proposal = await confirming.send("please launch twice")
    [prompt] = await confirming.replies(proposal)
    first, second = call_id_of(proposal), call_id_of(proposal).replace(":0", ":1")
    assert "1. LAUNCH_ROCKET" in prompt
    assert "2. LAUNCH_ROCKET" in prompt
    assert first in prompt
    assert second in prompt

    await confirming.decide(first, approve=True)

    async def first_settled() -> bool:
        return (await confirming.tool_call(first)).status == authz_pb2.TOOL_CALL_STATUS_SETTLED

    await eventually(first_settled, timeout=30, what="the approved call to be settled")
    assert confirming.effects(proposal) == 1
    assert await confirming.follow_ups(proposal) == [], "continued while a call was still pending"

    await confirming.decide(second, approve=False, reason="one is enough")
    assert await confirming.continuation(proposal) == ["All settled."]
    [follow_up] = await confirming.follow_ups(proposal)
    assert follow_up.text.splitlines()[1:] == [
        "1. LAUNCH_ROCKET: done - effect recorded",
        "2. LAUNCH_ROCKET: cancelled: not approved - one is enough",
    ]
    assert confirming.effects(proposal) == 1


async def test_a_user_denial_through_choice_never_runs_it(confirming: Confirming) -> None:
    proposal = await confirming.send("please launch")
    await confirming.replies(proposal, 2)
    answer = await confirming.send("no, cancel it")
    # Nothing else waits, so the agent's follow-up with the outcome is the answer.
    assert await confirming.continuation(proposal) == ["All settled."]
    assert await replies_to(confirming.bus, answer) == []
    call = await confirming.tool_call(call_id_of(proposal))
    assert call.outcome == authz_pb2.TOOL_OUTCOME_DENIED
    assert call.decided_by == str(uuid.uuid5(uuid.UUID(AGENT), "confirm:entity:alice"))  # the user's entity
    assert confirming.effects(proposal) == 0


async def test_a_user_approval_through_choice_runs_it_once(confirming: Confirming) -> None:
    proposal = await confirming.send("please launch")
    await confirming.replies(proposal, 2)
    await confirming.send("yes, go ahead")
    assert await confirming.continuation(proposal) == ["All settled."]
    call = await confirming.tool_call(call_id_of(proposal))
    assert call.outcome == authz_pb2.TOOL_OUTCOME_SUCCESS
    assert confirming.effects(proposal) == 1


async def test_someone_else_in_the_room_cannot_approve(confirming: Confirming) -> None:
    proposal = await confirming.send("please launch")
    await confirming.replies(proposal, 2)
    answer = await confirming.send("yes, go ahead", sender="mallory")
    assert await confirming.replies(answer) == ["Nothing here is waiting for your confirmation."]
    call = await confirming.tool_call(call_id_of(proposal))
    assert call.status == authz_pb2.TOOL_CALL_STATUS_PENDING
    assert confirming.effects(proposal) == 0


async def test_redelivered_claim_events_never_run_the_handler_twice(confirming: Confirming) -> None:
    """Every copy of the approval's event, raced over both replicas, finds the effect claim."""
    proposal = await confirming.send("please launch")
    await confirming.replies(proposal, 2)
    call_id = call_id_of(proposal)
    await confirming.decide(call_id, approve=True)
    assert await confirming.continuation(proposal) == ["All settled."]
    subject = confirming.bus.subjects.events(AGENT, "TOOL_CALL_CLAIMED")
    claimed = [
        m.data
        for m in await stream_messages(confirming.bus, subject)
        if authz_pb2.ToolCallEvent.FromString(m.data).tool_call.tool_call_id == call_id
    ]
    assert len(claimed) == 1
    await asyncio.gather(
        *(confirming.bus.publish(subject, claimed[0], msg_id=f"replay-{call_id}-{n}") for n in range(20))
    )

    async def consumed() -> bool:
        for durable in ("runtime-tool-call-claimed", "runtime-tool-call-settled"):
            info = await confirming.bus.js.consumer_info(confirming.bus.subjects.stream("EVENTS"), durable)
            if info.num_pending or info.num_ack_pending:
                return False
        return True

    await eventually(consumed, timeout=30, what="the replayed events to be handled")
    assert confirming.effects(proposal) == 1
    assert len(await confirming.follow_ups(proposal)) == 1
    call = await confirming.tool_call(call_id)
    assert call.outcome == authz_pb2.TOOL_OUTCOME_SUCCESS


async def test_a_confirmation_nobody_answers_expires_as_denied_and_the_conversation_continues(
    confirming: Confirming,
) -> None:
    hasty = agent_id("hasty")
    proposal = inbound("please record this", agent_id=hasty, channel=confirming.channel, source="confirm")
    await publish_inbound(confirming.bus, proposal)
    replies = await confirming.replies(proposal, 2)
    assert replies[0] == "Recorded."
    assert replies[1].startswith("Before I go ahead I need your confirmation:\n1. RECORD_EFFECT")
    prompt_id = [r.response_id for r in await replies_to(confirming.bus, proposal)][1]
    follow_up = runtime_pb2.InboundMessage(
        agent_id=hasty, source="confirm", message_id=f"confirmations:{prompt_id}"
    )
    assert await confirming.replies(follow_up) == ["All settled."]
    call = await confirming.authz.GetToolCall(
        authz_pb2.GetToolCallRequest(
            agent_id=hasty, tool_call_id=f"{turn_id(hasty, 'confirm', proposal.message_id)}:0"
        ),
        metadata=confirming.metadata,
        timeout=10,
    )
    assert call.outcome == authz_pb2.TOOL_OUTCOME_EXPIRED
    assert call.decided_by == "expiry"
    with psycopg.connect(confirming.suite.env.database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM public.effect_log WHERE turn_id = %s",
            (turn_id(hasty, "confirm", proposal.message_id),),
        ).fetchone()
    assert row == (0,)


async def test_a_runtime_killed_while_running_an_approved_action_leaves_it_stuck_never_run_twice(
    isolated_suite: Suite, tmp_path: Path
) -> None:
    """The approved handler writes its effect, then its runtime is SIGKILLed before it settles.
    The claim event comes back to the replacement runtime, which finds the effect claim without a
    result and does not run it again: the call stays claimed and is listed as stuck until an
    operator settles it (a stale token is refused), and then the conversation continues."""
    database_url = isolated_suite.env.database_url
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(EFFECT_LOG_DDL)
    # The handler takes 4 s: 2 s before its effect row is written and 2 s after.
    settings = {
        "PARLEY_CHARACTERS_DIR": str(effects_characters(tmp_path / "characters", database_url, 4000)),
        "PYTHONPATH": python_path(),
        "PARLEY_ACK_WAIT_SECONDS": "2",
    }
    suite = await isolated_suite.start(runtimes=1, **settings)
    authz = await suite.add_service("parley_authz", "AUTHZ")
    bus = await suite.connect()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{authz.grpc_port}")
    confirming = Confirming(suite, bus, authz_pb2_grpc.AuthzStub(channel), f"127.0.0.1:{authz.grpc_port}")
    try:
        proposal = await confirming.send("please launch")
        await confirming.replies(proposal, 2)
        call_id = call_id_of(proposal)
        await confirming.decide(call_id, approve=True)

        async def effect_written() -> bool:
            return confirming.effects(proposal) == 1

        await eventually(effect_written, timeout=30, interval=0.05, what="the handler's effect")
        suite.runtime.kill()  # mid-handler: the effect happened, the result was never recorded
        await suite.add_runtime(**settings)

        async def redelivered_and_handled() -> bool:
            info = await bus.js.consumer_info(bus.subjects.stream("EVENTS"), "runtime-tool-call-claimed")
            # Delivered twice (to the killed runtime, then again), and acknowledged.
            return info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.consumer_seq >= 2

        await eventually(redelivered_and_handled, timeout=30, what="the claim event redelivered and handled")
        assert confirming.effects(proposal) == 1, "the handler ran again"
        call = await confirming.tool_call(call_id)
        assert call.status == authz_pb2.TOOL_CALL_STATUS_CLAIMED
        stuck = confirming.cli("approvals", "stuck", "--agent", "effects", "--older-than", "0")
        assert stuck.returncode == 0, stuck.stderr
        assert call_id in stuck.stdout

        stale = confirming.cli(
            "approvals", "settle", call_id, "--agent", "effects", "--outcome", "indeterminate",
            "--claim-token", "00000000-0000-4000-8000-000000000000", "--note", "checked the pad",
        )  # fmt: skip
        assert stale.returncode != 0
        assert "the claim token does not match the claim" in stale.stderr
        token = (await confirming.authz.ListStuckToolCalls(
            authz_pb2.ListStuckToolCallsRequest(agent_id=AGENT), metadata=confirming.metadata, timeout=10
        )).tool_calls[0].claim.token  # fmt: skip
        settled = confirming.cli(
            "approvals", "settle", call_id, "--agent", "effects", "--outcome", "indeterminate",
            "--claim-token", token, "--note", "the rocket left; checked the pad",
        )  # fmt: skip
        assert settled.returncode == 0, settled.stderr
        assert await confirming.continuation(proposal) == ["All settled."]
        [follow_up] = await confirming.follow_ups(proposal)
        assert "1. LAUNCH_ROCKET: outcome unknown (settled by an operator)" in follow_up.text
        assert confirming.effects(proposal) == 1
    finally:
        await channel.close()
        await bus.close()
