"""The client side of the pairing service, shared by the runtime, the CLI and the service itself.

- ``page_bounds``: the pairing pages' limit and offset, validated from whatever a
  caller sent (an int from protobuf, a string from the command line, any JSON
  value), with an error that names the field.
- ``DmPolicy`` and ``PairingGate``: who may talk to an agent in a DM. The runtime
  asks the gate before a turn; the gate calls the pairing service over NATS and
  fails closed when it does not answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from parley.v1 import pairing_pb2

from .errors import InvalidArgument, ParleyError
from .logging import get_logger
from .rpc import RpcClient

log = get_logger(__name__)

SERVICE = "pairing"
DEFAULT_LIMIT = 50
MAX_LIMIT = 100
MAX_OFFSET = 2**63 - 1  # the wire's int64 and SQL's bigint
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _integer(value: object, field: str, requirement: str) -> int:
    # bool is an int in Python, and 1.0 or "1.5" are not integers the caller meant.
    if isinstance(value, bool):
        raise InvalidArgument(f"{field} must be {requirement}, got a boolean", code="INVALID_PAGE")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        return int(value.strip())
    shown = (
        repr(value)
        if isinstance(value, int | float | str) and len(repr(value)) <= 40
        else type(value).__name__
    )
    raise InvalidArgument(f"{field} must be {requirement}, got {shown}", code="INVALID_PAGE")


def page_bounds(limit: object = None, offset: object = None) -> tuple[int, int]:
    """(limit, offset) of a pairing page: limit 1–100 (None: 50), offset ≥ 0 (None: 0), both integers."""
    limit_requirement = f"an integer from 1 to {MAX_LIMIT}"
    checked_limit = DEFAULT_LIMIT if limit is None else _integer(limit, "limit", limit_requirement)
    if not 1 <= checked_limit <= MAX_LIMIT:
        raise InvalidArgument(f"limit must be {limit_requirement}, got {checked_limit}", code="INVALID_PAGE")
    checked_offset = 0 if offset is None else _integer(offset, "offset", "an integer of 0 or more")
    if checked_offset < 0:
        raise InvalidArgument(
            f"offset must be an integer of 0 or more, got {checked_offset}", code="INVALID_PAGE"
        )
    if checked_offset > MAX_OFFSET:
        raise InvalidArgument(
            f"offset must be at most {MAX_OFFSET}, got {checked_offset}", code="INVALID_PAGE"
        )
    return checked_limit, checked_offset


class DmPolicy(StrEnum):
    """Who may talk to an agent in a direct message, per agent and channel."""

    OPEN = "open"  # anyone
    PAIRING = "pairing"  # the allowlist; an unknown sender gets a code for an operator to approve
    ALLOWLIST = "allowlist"  # the allowlist only; anyone else is ignored
    CLOSED = "closed"  # nobody


def dm_policy(value: object, field: str = "dm_policy") -> DmPolicy:
    if isinstance(value, str):
        try:
            return DmPolicy(value.strip().lower())
        except ValueError:
            pass
    choices = ", ".join(p.value for p in DmPolicy)
    raise InvalidArgument(f"{field} must be one of {choices}", code="INVALID_DM_POLICY")


UNAVAILABLE_REPLY = "Pairing is temporarily unavailable, so I cannot answer you yet. Please try again later."
FULL_REPLY = (
    "I can't take new contacts on this channel right now: too many requests are waiting for approval. "
    "Please try again later."
)


def pairing_reply(channel: str, code: str, agent_name: str = "") -> str:
    command = f"parley pairing approve {channel} {code}"
    if agent_name and agent_name != "default":
        command += f" --agent {agent_name}"
    return f"Hi! I don't know you yet. To talk to me, ask my operator to run: {command}"


@dataclass(frozen=True)
class Admission:
    """The gate's decision about one inbound DM."""

    serve: bool  # run the turn as usual
    # open, allowed | closed, not_allowed, pairing_code, pairing_full, pairing_told, rejected, unavailable
    reason: str
    reply: str | None = None  # what to answer instead of a turn; None: stay silent
    code: str | None = None  # the sender's pairing code, when there is one


class PairingGate:
    """Asks the pairing service whether a sender may talk to an agent.

    With policy ``pairing`` an unknown sender gets a request and code, and the
    reply carrying the code at most once per TTL window (the service's claim),
    however many messages they send and however many runtime replicas handle
    them. Any failure to get an answer fails closed: the sender is not served.
    """

    def __init__(self, rpc: RpcClient, *, timeout: float = 2.0) -> None:
        self.rpc = rpc
        self.timeout = timeout

    async def admit(
        self,
        *,
        agent_id: str,
        channel: str,
        sender_id: str,
        policy: DmPolicy,
        agent_name: str = "",
        metadata: dict[str, str] | None = None,
    ) -> Admission:
        if policy is DmPolicy.OPEN:
            return Admission(True, "open")
        if policy is DmPolicy.CLOSED:
            return Admission(False, "closed")
        try:
            allowed = await self.rpc.call(
                SERVICE,
                "IsAllowed",
                pairing_pb2.IsAllowedRequest(agent_id=agent_id, channel=channel, sender_id=sender_id),
                pairing_pb2.IsAllowedResponse,
                timeout=self.timeout,
            )
            if allowed.allowed:
                return Admission(True, "allowed")
            if policy is DmPolicy.ALLOWLIST:
                return Admission(False, "not_allowed")
            await self.rpc.call(
                SERVICE,
                "UpsertRequest",
                pairing_pb2.UpsertRequestRequest(
                    agent_id=agent_id, channel=channel, sender_id=sender_id, metadata=metadata or {}
                ),
                pairing_pb2.UpsertRequestResponse,
                timeout=self.timeout,
            )
            claim = await self.rpc.call(
                SERVICE,
                "ClaimPairingReply",
                pairing_pb2.ClaimPairingReplyRequest(agent_id=agent_id, channel=channel, sender_id=sender_id),
                pairing_pb2.ClaimPairingReplyResponse,
                timeout=self.timeout,
            )
        except InvalidArgument as exc:
            # Permanent (say, a source name the service refuses as a channel): no point telling
            # the sender to try again, and still no turn.
            log.warning(
                "pairing gate refused the message", agent_id=agent_id, channel=channel, error=exc.message
            )
            return Admission(False, "rejected")
        except ParleyError as exc:
            log.warning(
                "pairing gate failed closed",
                agent_id=agent_id,
                channel=channel,
                code=exc.code,
                error=exc.message,
            )
            return Admission(False, "unavailable", UNAVAILABLE_REPLY)
        if not claim.claimed:
            return Admission(False, "pairing_told", code=claim.code or None)
        if not claim.code:
            return Admission(False, "pairing_full", FULL_REPLY)
        return Admission(False, "pairing_code", pairing_reply(channel, claim.code, agent_name), claim.code)
