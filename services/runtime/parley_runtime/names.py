"""The runtime's fixed vocabulary: room types, participant roles, what an action may be called."""

from __future__ import annotations

import re

from parley.v1 import runtime_pb2

ROLES = ("OWNER", "ADMIN", "MEMBER", "GUEST", "NONE")
ACTION_NAME = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")

ROOM_TYPES = {value: name.removeprefix("ROOM_TYPE_") for name, value in runtime_pb2.RoomType.items()}
ROOM_TYPES[runtime_pb2.ROOM_TYPE_UNSPECIFIED] = "GROUP"
ROOM_TYPE_VALUES = {name: value for value, name in ROOM_TYPES.items() if value}
DM_ROOMS = frozenset({"DM", "VOICE_DM"})
# Rooms of one person with the agent: the agent always answers, and the sender's private
# knowledge may be quoted.
PRIVATE_ROOMS = frozenset({"DM", "VOICE_DM", "SELF", "API"})
