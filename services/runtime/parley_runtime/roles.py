"""Participant roles: who decides them, and how far a connector's claim may go.

A connector states a sender's role in ``metadata.sender_role``. A claim is capped at the agent's
``CONNECTOR_ROLE_CEILING`` (default MEMBER: a connector cannot make anyone an ADMIN or OWNER
unless the agent's character says it may), and it never changes a role the operator set with
``SetParticipantRole`` (``parley participants role``): the operator's role is the role.
"""

from __future__ import annotations

from .agents.directory import AgentInfo
from .names import ROLES

CEILING_SETTING = "CONNECTOR_ROLE_CEILING"
DEFAULT_CEILING = "MEMBER"
# Lowest first.
RANK = {role: rank for rank, role in enumerate(reversed(ROLES))}


def ceiling(agent: AgentInfo) -> str:
    value = str(agent.setting(CEILING_SETTING) or DEFAULT_CEILING).strip().upper()
    return value if value in RANK else DEFAULT_CEILING


def capped_claim(agent: AgentInfo, claimed: str | None) -> str | None:
    """The connector's claim, no higher than the agent's ceiling (None: no claim)."""
    if not claimed:
        return None
    top = ceiling(agent)
    return claimed if RANK[claimed] <= RANK[top] else top


def turn_role(stored: str | None, stored_source: str | None, claim: str | None) -> str:
    """The sender's role for this turn's role gate: the operator's role when one is set, else the
    (capped) claim of this message, else the stored role, else MEMBER."""
    if stored is not None and stored_source == "operator":
        return stored
    return claim or stored or "MEMBER"
