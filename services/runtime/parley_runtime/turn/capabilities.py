"""Capability authorization in the turn: an action that acts through an account (its
``Capability``) runs only after authz's one-shot ``Authorize`` succeeds for its exact parameters.

For each run the runtime binds a request (the account and snapshot the agent's settings name, the
capability, operation and risk, and the digest of the parameters), registers its policy decision
(allowed: the turn's own gates - roles, private actions, and a person's approval when the action is
confirm-tagged - have passed) under a decision id derived from the run, and authorizes it. Authorize
consumes the decision: of any number of replicas racing one decision exactly one runs the action.
When the account's snapshot is no longer current (revoked or replaced in authz) the authority is
burned and the action reports ``STALE_CAPABILITY_AUTHORIZATION`` instead of running. After the
handler, a receipt of what it did is recorded against the authorization.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import authz_pb2
from parley.v1.authz_nats import AuthzClient
from parley_platform import canonical
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from ..agents.directory import AgentInfo
from ..sdk import Action, ActionResult, Capability
from .approvals import arguments_digest

log = get_logger(__name__)

RISKS = {
    "R0": authz_pb2.RISK_LEVEL_R0,
    "R1": authz_pb2.RISK_LEVEL_R1,
    "R2": authz_pb2.RISK_LEVEL_R2,
    "R3": authz_pb2.RISK_LEVEL_R3,
}
DECISION_TTL_MS = 60_000


def setting_prefix(capability: Capability) -> str:
    return "CAPABILITY_" + re.sub(r"[^A-Z0-9]+", "_", capability.name.upper()).strip("_")


def _ms(value: int) -> Timestamp:
    return Timestamp(seconds=value // 1000, nanos=(value % 1000) * 1_000_000)


@dataclass(frozen=True)
class Approval:
    """A registered policy decision for one bound request: what Authorize consumes once."""

    request: authz_pb2.CapabilityRequest
    decision_id: str
    decision_digest: str


class Refused(Exception):
    """The action must not run: ``code`` and a message the result reports (never a secret)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class CapabilityGate:
    def __init__(self, authz: AuthzClient) -> None:
        self.authz = authz

    async def approve(
        self, agent: AgentInfo, action: Action, params: Mapping[str, Any], decision_id: str
    ) -> Approval:
        """Bind the request for these exact parameters and register the runtime's decision."""
        capability = action.capability
        assert capability is not None
        prefix = setting_prefix(capability)
        account = str(agent.setting(f"{prefix}_ACCOUNT") or "")
        snapshot = str(agent.setting(f"{prefix}_SNAPSHOT") or "")
        if not account or not snapshot:
            raise Refused(
                "CAPABILITY_NOT_CONFIGURED",
                f"{action.name} needs {prefix}_ACCOUNT and {prefix}_SNAPSHOT in the agent's settings",
            )
        risk = RISKS.get(capability.risk.upper())
        if risk is None:
            raise Refused("CAPABILITY_NOT_CONFIGURED", f"{action.name}'s risk must be R0, R1, R2 or R3")
        try:
            bound = await self.authz.BindCapabilityRequest(
                authz_pb2.BindCapabilityRequestRequest(
                    agent_id=str(agent.id),
                    account_id=account,
                    snapshot_version=snapshot,
                    capability=capability.name,
                    operation=capability.operation,
                    catalog_risk=risk,
                    input_digest=arguments_digest(params),
                )
            )
            issued = canonical.millis(bound.request.bound_at)
            decision = authz_pb2.PolicyDecision(
                version=1,
                decision_id=decision_id,
                request_digest=bound.request_digest,
                outcome=authz_pb2.POLICY_OUTCOME_ALLOWED,
                issued_at=_ms(issued),
                expires_at=_ms(issued + DECISION_TTL_MS),
            )
            decision.digest = canonical.decision_digest(decision)
            await self.authz.RegisterDecision(
                authz_pb2.RegisterDecisionRequest(request=bound.request, decision=decision)
            )
        except ParleyError as exc:
            raise Refused(exc.code, str(exc)) from None
        return Approval(bound.request, decision_id, decision.digest)

    async def authorize(self, approval: Approval) -> authz_pb2.CapabilityAuthorization:
        """Consume the decision; exactly one caller of any number gets the authorization."""
        try:
            reply = await self.authz.Authorize(
                authz_pb2.AuthorizeRequest(
                    request=approval.request,
                    decision_id=approval.decision_id,
                    decision_digest=approval.decision_digest,
                )
            )
        except ParleyError as exc:
            raise Refused(exc.code, str(exc)) from None
        return reply.authorization

    async def receipt(self, authorization: authz_pb2.CapabilityAuthorization, result: ActionResult) -> None:
        """What the authorized dispatch did, recorded against its authorization (best effort)."""
        now = int(time.time() * 1000)
        receipt = authz_pb2.EffectReceipt(
            version=1,
            authorization_id=authorization.id,
            request_digest=authorization.request_digest,
            decision_digest=authorization.decision_digest,
            grant_digest=authorization.grant_digest,
            account_id=authorization.account_id,
            capability=authorization.capability,
            operation=authorization.operation,
            input_digest=authorization.input_digest,
            idempotency_key=authorization.request_digest,
            status=authz_pb2.EFFECT_STATUS_COMMITTED if result.success else authz_pb2.EFFECT_STATUS_FAILED,
            observed_at=_ms(now),
        )
        if result.success:
            receipt.committed_at.CopyFrom(_ms(now))
        else:
            receipt.error_code = authz_pb2.EXECUTION_ERROR_CODE_UNKNOWN_ERROR
        try:
            await self.authz.RecordReceipt(
                authz_pb2.RecordReceiptRequest(agent_id=authorization.agent_id, receipt=receipt)
            )
        except ParleyError as exc:
            log.warning("capability receipt not recorded", code=exc.code, capability=authorization.capability)

    async def run(
        self,
        agent: AgentInfo,
        action: Action,
        params: Mapping[str, Any],
        decision_id: str,
        handler: Callable[[], Awaitable[tuple[ActionResult, str]]],
    ) -> tuple[ActionResult, str]:
        """Approve, authorize once, then run ``handler``; a refusal is a failed result naming why."""
        try:
            authorization = await self.authorize(await self.approve(agent, action, params, decision_id))
        except Refused as refused:
            outcome = "stale" if refused.code.startswith("STALE_") else "unauthorized"
            log.info(
                "capability not authorized", action=action.name, agent_id=str(agent.id), code=refused.code
            )
            return ActionResult(False, error=agent.redactor.redact(str(refused))), outcome
        result, outcome = await handler()
        result.values["authorization_id"] = authorization.id
        await self.receipt(authorization, result)
        return result, outcome
