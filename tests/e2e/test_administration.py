"""Operator administration and capability authorization, on real processes (runtime, gateway,
authz, NATS, PostgreSQL): roles the operator sets take effect on the next turn's role gate and a
connector's claim cannot raise them; rooms and worlds are muted for a while; the agent's rooms,
worlds, entities, participants and relationships are read over gRPC; reply attachments reach the
connector; an action with a capability runs only after authz's one-shot Authorize, and a stale
account snapshot burns the authority and is reported."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import authz_pb2, authz_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from parley.v1.runtime_nats import RuntimeClient
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from parley_runtime import ids
from support import AGENT_NAMESPACE, ROOT, SessionEnv, Suite, inbound, publish_inbound, replies_to

STEWARD = uuid.uuid5(AGENT_NAMESPACE, "agent:steward")
TERMINAL = ("replied", "ignored", "failed", "superseded")
CHARACTER = """
name: steward
system: You are a test agent for operator administration.
bio: [An agent whose operator sets roles and mutes.]
plugins: ["plugins.fixtures:fixtures_plugin"]
settings:
  CAPABILITY_PAYMENTS_TRANSFER_ACCOUNT: acct-steward
  CAPABILITY_PAYMENTS_TRANSFER_SNAPSHOT: snap-1
"""


class Admin:
    def __init__(
        self,
        suite: Suite,
        bus: Bus,
        runtime: runtime_pb2_grpc.RuntimeStub,
        authz: authz_pb2_grpc.AuthzStub,
        log: Path,
    ) -> None:
        self.suite = suite
        self.bus = bus
        self.runtime = runtime
        self.authz = authz
        self.log = log
        self.metadata = [("authorization", f"Bearer {suite.env.token}")]

    def lines(self, prefix: str) -> list[str]:
        text = self.log.read_text() if self.log.exists() else ""
        return [line for line in text.splitlines() if line.startswith(prefix)]

    async def call(self, stub: Any, method: str, request: Any) -> Any:
        return await getattr(stub, method)(request, metadata=self.metadata, timeout=15)

    async def send(
        self,
        text: str,
        *,
        channel: str,
        sender: str = "bob",
        world: str = "",
        metadata: dict[str, str] | None = None,
    ) -> runtime_pb2.InboundMessage:
        message = inbound(
            text, agent_id=str(STEWARD), channel=channel, sender=sender, room_type=runtime_pb2.ROOM_TYPE_GROUP
        )
        message.mentions_agent = True
        message.world_id = world
        message.metadata.update(metadata or {})
        await publish_inbound(self.bus, message)
        return message

    async def finished(self, message: runtime_pb2.InboundMessage) -> dict[str, Any]:
        def turn() -> dict[str, Any] | None:
            with psycopg.connect(self.suite.env.database_url) as conn:
                row = conn.execute(
                    "SELECT state, reason, trajectory FROM runtime.turn WHERE agent_id = %s AND id = %s",
                    (STEWARD, ids.message_id(STEWARD, message.source, message.message_id)),
                ).fetchone()
            if row is None or row[0] not in TERMINAL:
                return None
            return {"state": row[0], "reason": row[1], "trajectory": row[2] or {}}

        async def done() -> dict[str, Any] | None:
            return turn()

        return await eventually(done, timeout=30, what=f"the turn of {message.text!r}")

    async def action(self, message: runtime_pb2.InboundMessage, name: str) -> dict[str, Any]:
        turn = await self.finished(message)
        [found] = [a for a in turn["trajectory"].get("actions", []) if a["name"] == name]
        return dict(found)


@pytest.fixture(scope="module")
async def admin(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Admin]:
    root = tmp_path_factory.mktemp("admin")
    characters = root / "characters"
    characters.mkdir()
    shutil.copy(ROOT / "characters" / "default.yaml", characters)
    (characters / "steward.yaml").write_text(CHARACTER)
    log = root / "fixtures.log"
    suite = Suite(test_env, root / "logs", f"a{secrets.token_hex(4)}")
    await suite.start(
        runtimes=1,
        PARLEY_CHARACTERS_DIR=str(characters),
        PARLEY_TRAJECTORY_LOGGING="true",
        PYTHONPATH=str(ROOT / "tests"),
        FIXTURE_LOG=str(log),
    )
    authz = await suite.add_service("parley_authz", "AUTHZ")
    bus = await suite.connect()
    runtime_channel = grpc.aio.insecure_channel(f"127.0.0.1:{suite.runtime.grpc_port}")
    authz_channel = grpc.aio.insecure_channel(f"127.0.0.1:{authz.grpc_port}")
    try:
        yield Admin(
            suite,
            bus,
            runtime_pb2_grpc.RuntimeStub(runtime_channel),
            authz_pb2_grpc.AuthzStub(authz_channel),
            log,
        )
    finally:
        await runtime_channel.close()
        await authz_channel.close()
        await bus.close()
        suite.stop()


async def test_role_changes_take_effect_on_the_next_turns_role_gate(admin: Admin) -> None:
    channel = f"roles-{secrets.token_hex(3)}"
    room = str(ids.room_id(STEWARD, "e2e", channel))
    bob = str(ids.entity_id(STEWARD, "e2e", "bob"))
    # A connector's claim above MEMBER is capped (the steward has no CONNECTOR_ROLE_CEILING).
    claimed = await admin.send("run the admin op", channel=channel, metadata={"sender_role": "ADMIN"})
    assert (await admin.action(claimed, "ADMIN_OP"))["outcome"] == "rejected"
    [member] = (
        await admin.call(
            admin.runtime,
            "ListParticipants",
            runtime_pb2.ListParticipantsRequest(agent_id="steward", room_id=room, entity_id=bob),
        )
    ).participants
    assert (member.role, member.role_source, list(member.names)) == ("MEMBER", "connector", ["Bob"])

    granted = await admin.call(
        admin.runtime,
        "SetParticipantRole",
        runtime_pb2.SetParticipantRoleRequest(agent_id="steward", room_id=room, entity_id=bob, role="admin"),
    )
    assert (granted.role, granted.role_source) == ("ADMIN", "operator")
    # The next turn's gate reads it; a connector claiming less does not lower it.
    ran = await admin.send("run the admin op", channel=channel, metadata={"sender_role": "NONE"})
    assert (await admin.action(ran, "ADMIN_OP"))["outcome"] == "success"
    assert any(line.endswith(" ADMIN") for line in admin.lines("ADMIN_OP"))

    await admin.call(
        admin.runtime,
        "SetParticipantRole",
        runtime_pb2.SetParticipantRoleRequest(agent_id="steward", room_id=room, entity_id=bob, role="MEMBER"),
    )
    # Nor does a connector claiming more raise it back.
    again = await admin.send("run the admin op", channel=channel, metadata={"sender_role": "OWNER"})
    assert (await admin.action(again, "ADMIN_OP"))["outcome"] == "rejected"


@pytest.mark.parametrize(
    ("request_", "status", "says"),
    [
        (
            runtime_pb2.SetParticipantRoleRequest(agent_id="steward", role="ROOT"),
            "INVALID_ARGUMENT",
            "room_id",
        ),
        (
            runtime_pb2.SetParticipantRoleRequest(
                agent_id="steward", room_id=str(uuid.uuid4()), entity_id=str(uuid.uuid4()), role="ROOT"
            ),
            "INVALID_ARGUMENT",
            "role must be one of",
        ),
        (
            runtime_pb2.SetParticipantRoleRequest(
                agent_id="steward", room_id=str(uuid.uuid4()), entity_id=str(uuid.uuid4()), role="ADMIN"
            ),
            "NOT_FOUND",
            "has no room",
        ),
        (runtime_pb2.SetMuteRequest(agent_id="steward", muted=True), "INVALID_ARGUMENT", "exactly one"),
        (
            runtime_pb2.SetMuteRequest(agent_id="steward", room_id=str(uuid.uuid4()), muted=True),
            "NOT_FOUND",
            "has no room",
        ),
        (
            runtime_pb2.SetMuteRequest(
                agent_id="steward", room_id=str(uuid.uuid4()), muted=True, duration_seconds=-1
            ),
            "INVALID_ARGUMENT",
            "duration_seconds",
        ),
        (
            runtime_pb2.SetMuteRequest(
                agent_id="steward", world_id=str(uuid.uuid4()), muted=True, until=Timestamp(seconds=1000)
            ),
            "INVALID_ARGUMENT",
            "future",
        ),
        (
            runtime_pb2.SetMuteRequest(
                agent_id="steward", world_id=str(uuid.uuid4()), muted=False, duration_seconds=5
            ),
            "INVALID_ARGUMENT",
            "unmute",
        ),
    ],
)
async def test_bad_administration_requests_say_what_is_wrong(
    admin: Admin, request_: Any, status: str, says: str
) -> None:
    method = (
        "SetParticipantRole" if isinstance(request_, runtime_pb2.SetParticipantRoleRequest) else "SetMute"
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admin.call(admin.runtime, method, request_)
    assert caught.value.code().name == status
    assert says in (caught.value.details() or "")


async def test_timed_mutes_of_a_room_and_a_world(admin: Admin) -> None:
    channel = f"mute-{secrets.token_hex(3)}"
    world = f"guild-{secrets.token_hex(3)}"
    first = await admin.send("hello there", channel=channel, world=world)
    assert (await admin.finished(first))["state"] == "replied"
    room = str(ids.room_id(STEWARD, "e2e", channel))
    world_id = str(ids.world_id(STEWARD, "e2e", world))

    worlds = await admin.call(admin.runtime, "ListWorlds", runtime_pb2.ListWorldsRequest(agent_id="steward"))
    [listed] = [w for w in worlds.worlds if w.id == world_id]
    assert (listed.external_id, listed.rooms, listed.muted) == (world, 1, False)

    muted = await admin.call(
        admin.runtime,
        "SetMute",
        runtime_pb2.SetMuteRequest(agent_id="steward", world_id=world_id, muted=True, duration_seconds=4),
    )
    assert muted.muted
    assert muted.HasField("until")
    silent = await admin.send("anyone home", channel=channel, world=world)
    assert (await admin.finished(silent))["reason"] == "world_muted"
    rooms = await admin.call(
        admin.runtime, "ListRooms", runtime_pb2.ListRoomsRequest(agent_id="steward", world_id=world_id)
    )
    assert [r.id for r in rooms.rooms] == [room]
    worlds = await admin.call(admin.runtime, "ListWorlds", runtime_pb2.ListWorldsRequest(agent_id="steward"))
    assert [w.muted for w in worlds.worlds if w.id == world_id] == [True]

    # The world's mute lapses on its own; then a mute of the room until a time, and an unmute.
    async def answered() -> bool:
        message = await admin.send("are you back", channel=channel, world=world)
        return (await admin.finished(message))["state"] == "replied"

    await eventually(answered, timeout=30, what="the world's mute to lapse")
    until = Timestamp()
    until.FromDatetime(datetime.now(UTC) + timedelta(hours=1))
    await admin.call(
        admin.runtime,
        "SetMute",
        runtime_pb2.SetMuteRequest(agent_id="steward", room_id=room, muted=True, until=until),
    )
    rooms = await admin.call(
        admin.runtime, "ListRooms", runtime_pb2.ListRoomsRequest(agent_id="steward", world_id=world_id)
    )
    assert rooms.rooms[0].muted
    assert rooms.rooms[0].mute_until.seconds == until.seconds
    quiet = await admin.send("still there", channel=channel, world=world)
    assert (await admin.finished(quiet))["reason"] == "muted"
    await admin.call(
        admin.runtime, "SetMute", runtime_pb2.SetMuteRequest(agent_id="steward", room_id=room, muted=False)
    )
    back = await admin.send("hello again", channel=channel, world=world)
    assert (await admin.finished(back))["state"] == "replied"


async def test_entities_participants_and_relationships_are_listed(admin: Admin) -> None:
    channel = f"people-{secrets.token_hex(3)}"
    carol = await admin.send("hi from carol", channel=channel, sender="carol")
    dave = await admin.send("hi from dave", channel=channel, sender="dave")
    await admin.finished(carol)
    await admin.finished(dave)
    room = str(ids.room_id(STEWARD, "e2e", channel))
    found = await admin.call(
        admin.runtime, "ListEntities", runtime_pb2.ListEntitiesRequest(agent_id="steward", room_id=room)
    )
    names = {tuple(e.names) for e in found.entities}
    assert {("Carol",), ("Dave",)} <= names
    people = await admin.call(
        admin.runtime,
        "ListParticipants",
        runtime_pb2.ListParticipantsRequest(agent_id="steward", room_id=room),
    )
    assert {(p.role, p.role_source) for p in people.participants if p.names[0] in ("Carol", "Dave")} == {
        ("MEMBER", "connector")
    }
    # The same over NATS, as the operator (the only identity the runtime's RPCs are open to).
    over_nats = await RuntimeClient(RpcClient(admin.bus), timeout=15).ListParticipants(
        runtime_pb2.ListParticipantsRequest(agent_id=str(STEWARD), room_id=room)
    )
    assert {p.entity_id for p in over_nats.participants} == {p.entity_id for p in people.participants}
    c, d = (ids.entity_id(STEWARD, "e2e", who) for who in ("carol", "dave"))
    with psycopg.connect(admin.suite.env.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runtime.relationship (agent_id, id, source_entity_id, target_entity_id, tags)"
            " VALUES (%s, %s, %s, %s, %s)",
            (STEWARD, uuid.uuid4(), c, d, ["colleague", "friend"]),
        )
    listed = await admin.call(
        admin.runtime,
        "ListRelationships",
        runtime_pb2.ListRelationshipsRequest(agent_id="steward", entity_id=str(d), tag="friend"),
    )
    assert [(r.source_entity_id, r.target_entity_id, list(r.tags)) for r in listed.relationships] == [
        (str(c), str(d), ["colleague", "friend"])
    ]
    none = await admin.call(
        admin.runtime,
        "ListRelationships",
        runtime_pb2.ListRelationshipsRequest(agent_id="steward", entity_id=str(d), tag="rival"),
    )
    assert list(none.relationships) == []


async def test_reply_attachments_reach_the_connector(admin: Admin) -> None:
    message = await admin.send("attach the report", channel=f"files-{secrets.token_hex(3)}")
    [reply] = await eventually(lambda: replies_to(admin.bus, message), timeout=30, what="the reply")
    assert reply.text == "Here is the report."
    [attachment] = reply.attachments
    assert (attachment.id, attachment.url, attachment.title, attachment.content_type) == (
        "r1",
        "https://example.com/report.pdf",
        "Report",
        "application/pdf",
    )


async def test_a_capability_runs_once_authorized_and_a_stale_snapshot_is_reported(admin: Admin) -> None:
    await admin.call(
        admin.authz,
        "PutAccountSnapshot",
        authz_pb2.PutAccountSnapshotRequest(
            agent_id=str(STEWARD), account_id="acct-steward", snapshot_version="snap-1"
        ),
    )
    paid = await admin.send("pay invoice 7", channel=f"pay-{secrets.token_hex(3)}")
    action = await admin.action(paid, "PAY_OP")
    assert action["outcome"] == "success", action
    assert len(action["result"]["values"]["authorization_id"]) == 64
    assert admin.lines("PAY_OP") == ["PAY_OP inv-7"]

    # A confirm-tagged capability: the turn only asks; the approval runs it once, authorized.
    asked = await admin.send("pay after confirmation", channel=f"pay-{secrets.token_hex(3)}")
    assert (await admin.action(asked, "PAY_CONFIRMED"))["outcome"] == "pending"
    call_id = f"{ids.message_id(STEWARD, 'e2e', asked.message_id)}:0"
    await admin.call(
        admin.authz,
        "Decide",
        authz_pb2.DecideRequest(
            agent_id=str(STEWARD),
            tool_call_id=call_id,
            decision=authz_pb2.TOOL_DECISION_APPROVE,
            decided_by="e2e",
        ),
    )

    async def settled() -> authz_pb2.ToolCall | None:
        call = await admin.call(
            admin.authz,
            "GetToolCall",
            authz_pb2.GetToolCallRequest(agent_id=str(STEWARD), tool_call_id=call_id),
        )
        return call if call.outcome != authz_pb2.TOOL_OUTCOME_UNSPECIFIED else None

    call = await eventually(settled, timeout=30, what="the approved payment to settle")
    assert call.outcome == authz_pb2.TOOL_OUTCOME_SUCCESS, call
    assert admin.lines("PAY_OP") == ["PAY_OP inv-7", "PAY_OP inv-9"]

    # The account is reconnected under a new snapshot: the agent's snapshot-1 authority is stale.
    await admin.call(
        admin.authz,
        "PutAccountSnapshot",
        authz_pb2.PutAccountSnapshotRequest(
            agent_id=str(STEWARD), account_id="acct-steward", snapshot_version="snap-2"
        ),
    )
    stale = await admin.send("pay invoice 7", channel=f"pay-{secrets.token_hex(3)}")
    action = await admin.action(stale, "PAY_OP")
    assert action["outcome"] == "stale", action
    assert action["result"]["error"].startswith("STALE_CAPABILITY_AUTHORIZATION")
    assert admin.lines("PAY_OP") == ["PAY_OP inv-7", "PAY_OP inv-9"]


def cli(admin: Admin, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "PARLEY_NATS_URL": admin.suite.env.nats_url,
        "PARLEY_NAMESPACE": admin.suite.namespace,
        "PARLEY_OPERATOR_TOKEN": admin.suite.env.token,
        "PARLEY_RUNTIME_ADDR": f"127.0.0.1:{admin.suite.runtime.grpc_port}",
    }
    return subprocess.run(
        [str(Path(sys.executable).parent / "parley"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_cli_lists_sets_roles_and_mutes(admin: Admin) -> None:
    channel = f"cli-{secrets.token_hex(3)}"
    message = await admin.send("hello from erin", channel=channel, sender="erin")
    await admin.finished(message)
    room = str(ids.room_id(STEWARD, "e2e", channel))
    erin = str(ids.entity_id(STEWARD, "e2e", "erin"))

    listed = cli(admin, "rooms", "list", "--agent", "steward")
    assert listed.returncode == 0, listed.stderr
    assert any(line.startswith(room) and channel in line for line in listed.stdout.splitlines())
    role = cli(admin, "participants", "role", room, erin, "owner", "--agent", "steward")
    assert role.returncode == 0, role.stderr
    assert role.stdout.strip() == f"{erin} is OWNER in room {room} (set by the operator)"
    people = cli(admin, "participants", "list", "--agent", "steward", "--room", room, "--json")
    [erin_row] = [p for p in json.loads(people.stdout)["items"] if p["entity_id"] == erin]
    assert (erin_row["role"], erin_row["role_source"]) == ("OWNER", "operator")
    entities = cli(admin, "entities", "list", "--agent", "steward", "--room", room)
    assert "Erin" in entities.stdout

    muted = cli(admin, "rooms", "mute", room, "--agent", "steward", "--for", "10m")
    assert muted.returncode == 0, muted.stderr
    assert muted.stdout.startswith(f"agent {STEWARD} muted in room {room} until ")
    quiet = await admin.send("anyone", channel=channel, sender="erin")
    assert (await admin.finished(quiet))["reason"] == "muted"
    unmuted = cli(admin, "rooms", "unmute", room, "--agent", "steward")
    assert unmuted.stdout.strip() == f"agent {STEWARD} unmuted in room {room}"

    bad = cli(admin, "rooms", "mute", room, "--agent", "steward", "--for", "soon")
    assert bad.returncode == 1
    assert "--for must be a number" in bad.stderr
    bad_role = cli(admin, "participants", "role", room, erin, "king", "--agent", "steward")
    assert bad_role.returncode == 1
    assert "role must be one of" in bad_role.stderr
    worlds = cli(admin, "worlds", "list", "--agent", "steward", "--json")
    assert worlds.returncode == 0, worlds.stderr
    relationships = cli(admin, "relationships", "list", "--agent", "steward", "--tag", "nobody")
    assert relationships.returncode == 0, relationships.stderr
    assert relationships.stdout.splitlines()[-1] == "(none)"
