"""Operator administration over gRPC: `parley rooms|worlds|entities|participants|relationships`.
Reading what an agent knows of the places and people it talks with, setting a person's role in a
room, and muting the agent in a room or a whole world (for good, until a time, or for a while)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

import typer
from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import common_pb2, runtime_pb2
from parley_platform.errors import InvalidArgument

from . import client, common
from .common import Agent, Json, Limit, Offset, command, when

rooms = common.group("rooms", "An agent's rooms: list them, mute or unmute the agent in one.")
worlds = common.group(
    "worlds", "An agent's worlds (servers, guilds): list them, mute or unmute a whole world."
)
entities = common.group("entities", "The people (and agents) an agent knows, with their names per connector.")
participants = common.group(
    "participants", "Who takes part in an agent's rooms, with their roles; set a role (operator's word)."
)
relationships = common.group(
    "relationships", "Relationships between entities an agent has learned, with tags."
)
APPS = (rooms, worlds, entities, participants, relationships)

Until = Annotated[
    str, typer.Option("--until", metavar="TIME", help="mute until this ISO time (e.g. 2026-12-24T18:00:00Z)")
]
For = Annotated[str, typer.Option("--for", metavar="DURATION", help="mute for 90s, 30m, 2h, 1d or SECONDS")]
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_seconds(text: str) -> float:
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text.lower())
    if found is None:
        raise InvalidArgument("--for must be a number with s, m, h or d (e.g. 30m)", code="INVALID_DURATION")
    return float(found.group(1)) * UNITS[found.group(2)]


def until_timestamp(text: str) -> Timestamp:
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise InvalidArgument(
            "--until must be an ISO time such as 2026-12-24T18:00:00Z", code="INVALID_TIME"
        ) from None
    if moment.tzinfo is None:
        raise InvalidArgument("--until needs a time zone (Z or +hh:mm)", code="INVALID_TIME")
    stamp = Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def mute_request(
    agent: str, *, room: str = "", world: str = "", muted: bool, until: str, for_: str
) -> runtime_pb2.SetMuteRequest:
    request = runtime_pb2.SetMuteRequest(agent_id=agent, room_id=room, world_id=world, muted=muted)
    if until:
        request.until.CopyFrom(until_timestamp(until))
    if for_:
        request.duration_seconds = duration_seconds(for_)
    return request


def show_mute(state: runtime_pb2.MuteState, json: bool) -> None:
    where = f"room {state.room_id}" if state.room_id else f"world {state.world_id}"
    if not state.muted:
        text = f"agent {state.agent_id} unmuted in {where}"
    elif state.HasField("until"):
        text = f"agent {state.agent_id} muted in {where} until {when(state.until)}"
    else:
        text = f"agent {state.agent_id} muted in {where} until unmuted"
    common.emit(json, state, text)


def _page(limit: int, offset: int) -> common_pb2.PageRequest:
    return common_pb2.PageRequest(limit=limit, offset=offset)


def _muted(item: runtime_pb2.Room | runtime_pb2.World) -> str:
    if not item.muted:
        return "-"
    return f"until {when(item.mute_until)}" if item.HasField("mute_until") else "yes"


@command(rooms, "list")
async def list_rooms(
    agent: Agent = "default",
    world: str = typer.Option("", metavar="WORLD_ID", help="only this world's rooms"),
    limit: Limit = 50,
    offset: Offset = 0,
    json: Json = False,
) -> None:
    """An agent's rooms: where it talks, on which connector and channel, and whether it is muted there."""
    request = runtime_pb2.ListRoomsRequest(agent_id=agent, world_id=world, page=_page(limit, offset))
    reply = await client.runtime("ListRooms", request)
    common.listing(
        json,
        reply.rooms,
        reply.page,
        ["ID", "SOURCE", "TYPE", "CHANNEL", "MUTED"],
        lambda r: [
            r.id,
            r.source,
            runtime_pb2.RoomType.Name(r.type).removeprefix("ROOM_TYPE_"),
            r.channel_id,
            _muted(r),
        ],
    )


@command(rooms)
async def mute(
    room: str = typer.Argument(..., metavar="ROOM_ID"),
    agent: Agent = "default",
    until: Until = "",
    for_: For = "",
    json: Json = False,
) -> None:
    """Mute the agent in a room: it still reads and remembers, and does not answer."""
    request = mute_request(agent, room=room, muted=True, until=until, for_=for_)
    show_mute(await client.runtime("SetMute", request), json)


@command(rooms)
async def unmute(
    room: str = typer.Argument(..., metavar="ROOM_ID"), agent: Agent = "default", json: Json = False
) -> None:
    """Let the agent answer in the room again."""
    request = mute_request(agent, room=room, muted=False, until="", for_="")
    show_mute(await client.runtime("SetMute", request), json)


@command(worlds, "list")
async def list_worlds(
    agent: Agent = "default", limit: Limit = 50, offset: Offset = 0, json: Json = False
) -> None:
    """An agent's worlds: a connector's servers or guilds, their rooms, and whether it is muted there."""
    reply = await client.runtime(
        "ListWorlds", runtime_pb2.ListWorldsRequest(agent_id=agent, page=_page(limit, offset))
    )
    common.listing(
        json,
        reply.worlds,
        reply.page,
        ["ID", "SOURCE", "EXTERNAL ID", "ROOMS", "MUTED"],
        lambda w: [w.id, w.source, w.external_id, w.rooms, _muted(w)],
    )


@command(worlds, "mute")
async def mute_world(
    world: str = typer.Argument(..., metavar="WORLD_ID"),
    agent: Agent = "default",
    until: Until = "",
    for_: For = "",
    json: Json = False,
) -> None:
    """Mute the agent in every room of a world."""
    request = mute_request(agent, world=world, muted=True, until=until, for_=for_)
    show_mute(await client.runtime("SetMute", request), json)


@command(worlds, "unmute")
async def unmute_world(
    world: str = typer.Argument(..., metavar="WORLD_ID"), agent: Agent = "default", json: Json = False
) -> None:
    """Let the agent answer in the world again."""
    request = mute_request(agent, world=world, muted=False, until="", for_="")
    show_mute(await client.runtime("SetMute", request), json)


@command(entities, "list")
async def list_entities(
    agent: Agent = "default",
    room: str = typer.Option("", metavar="ROOM_ID", help="only this room's participants"),
    limit: Limit = 50,
    offset: Offset = 0,
    json: Json = False,
) -> None:
    """The entities an agent knows: their ids and names."""
    request = runtime_pb2.ListEntitiesRequest(agent_id=agent, room_id=room, page=_page(limit, offset))
    reply = await client.runtime("ListEntities", request)
    common.listing(json, reply.entities, reply.page, ["ID", "NAMES"], lambda e: [e.id, ", ".join(e.names)])


@command(participants, "list")
async def list_participants(
    agent: Agent = "default",
    room: str = typer.Option("", metavar="ROOM_ID", help="only this room"),
    entity: str = typer.Option("", metavar="ENTITY_ID", help="only this entity"),
    limit: Limit = 50,
    offset: Offset = 0,
    json: Json = False,
) -> None:
    """Who takes part in the agent's rooms: their role, who set it (connector or operator), their state."""
    request = runtime_pb2.ListParticipantsRequest(
        agent_id=agent, room_id=room, entity_id=entity, page=_page(limit, offset)
    )
    reply = await client.runtime("ListParticipants", request)
    common.listing(
        json,
        reply.participants,
        reply.page,
        ["ROOM", "ENTITY", "NAMES", "ROLE", "SET BY", "STATE"],
        lambda p: [p.room_id, p.entity_id, ", ".join(p.names), p.role, p.role_source, p.state or "-"],
    )


@command(participants)
async def role(
    room: str = typer.Argument(..., metavar="ROOM_ID"),
    entity: str = typer.Argument(..., metavar="ENTITY_ID"),
    new_role: str = typer.Argument(..., metavar="ROLE", help="OWNER, ADMIN, MEMBER, GUEST or NONE"),
    agent: Agent = "default",
    json: Json = False,
) -> None:
    """Set an entity's role in a room. The next turn's role gate uses it, and no connector's claimed
    role changes it."""
    request = runtime_pb2.SetParticipantRoleRequest(
        agent_id=agent, room_id=room, entity_id=entity, role=new_role
    )
    found = await client.runtime("SetParticipantRole", request)
    common.emit(
        json, found, f"{found.entity_id} is {found.role} in room {found.room_id} (set by the operator)"
    )


@command(relationships, "list")
async def list_relationships(
    agent: Agent = "default",
    entity: str = typer.Option("", metavar="ENTITY_ID", help="only relationships of this entity"),
    tag: str = typer.Option("", metavar="TAG", help="only relationships with this tag"),
    limit: Limit = 50,
    offset: Offset = 0,
    json: Json = False,
) -> None:
    """Relationships between entities: source, target and tags, most recently updated first."""
    request = runtime_pb2.ListRelationshipsRequest(
        agent_id=agent, entity_id=entity, tag=tag, page=_page(limit, offset)
    )
    reply = await client.runtime("ListRelationships", request)
    common.listing(
        json,
        reply.relationships,
        reply.page,
        ["SOURCE", "TARGET", "TAGS", "UPDATED"],
        lambda r: [r.source_entity_id, r.target_entity_id, ", ".join(r.tags), when(r.updated_at)],
    )
