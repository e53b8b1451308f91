"""The client side of the pairing service, shared by the runtime and the service itself.

- ``DmPolicy`` and ``PairingGate``: who may talk to an agent in a DM. The runtime
  asks the gate before a turn; the gate calls the pairing service over NATS and
  fails closed when it does not answer: it raises DEPENDENCY_UNAVAILABLE (dependency
  ``pairing``), so the runtime's consumer holds the message until pairing is back instead of
  serving it or losing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from parley.v1 import pairing_pb2
from parley.v1.pairing_nats import PairingClient
from parley_platform import codes
from parley_platform.errors import InvalidArgument, ParleyError
from parley_platform.logging import get_logger
from parley_platform.rpc import RpcClient

log = get_logger(__name__)


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
    raise codes.INVALID_DM_POLICY(f"{field} must be one of {choices}")


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
    # open, allowed | closed, not_allowed, pairing_code, pairing_full, pairing_told, rejected
    reason: str
    reply: str | None = None  # what to answer instead of a turn; None: stay silent
    code: str | None = None  # the sender's pairing code, when there is one


class PairingGate:
    """Asks the pairing service whether a sender may talk to an agent.

    With policy ``pairing`` an unknown sender gets a request and code, and the
    reply carrying the code at most once per TTL window (the service's claim),
    however many messages they send and however many runtime replicas handle
    them. Any failure to get an answer fails closed: the sender is not served, and the gate raises
    DEPENDENCY_UNAVAILABLE so that the message waits for pairing.
    """

    def __init__(self, rpc: RpcClient, *, timeout: float = 2.0) -> None:
        self.pairing = PairingClient(rpc, timeout=timeout)

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
            allowed = await self.pairing.IsAllowed(
                pairing_pb2.IsAllowedRequest(agent_id=agent_id, channel=channel, sender_id=sender_id)
            )
            if allowed.allowed:
                return Admission(True, "allowed")
            if policy is DmPolicy.ALLOWLIST:
                return Admission(False, "not_allowed")
            await self.pairing.UpsertRequest(
                pairing_pb2.UpsertRequestRequest(
                    agent_id=agent_id, channel=channel, sender_id=sender_id, metadata=metadata or {}
                )
            )
            claim = await self.pairing.ClaimPairingReply(
                pairing_pb2.ClaimPairingReplyRequest(agent_id=agent_id, channel=channel, sender_id=sender_id)
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
                "pairing gate failed closed; the message waits for pairing",
                agent_id=agent_id,
                channel=channel,
                code=exc.code,
                error=exc.message,
            )
            unavailable = codes.DEPENDENCY_UNAVAILABLE(f"pairing did not answer ({exc.code})")
            unavailable.dependency = "pairing"
            raise unavailable from exc
        if not claim.claimed:
            return Admission(False, "pairing_told", code=claim.code or None)
        if not claim.code:
            return Admission(False, "pairing_full", FULL_REPLY)
        return Admission(False, "pairing_code", pairing_reply(channel, claim.code, agent_name), claim.code)
