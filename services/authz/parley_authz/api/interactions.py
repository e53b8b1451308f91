"""Interaction confirmations: an action registered, confirmed by a person (issued), used once."""

from __future__ import annotations

import uuid

from parley.v1 import authz_pb2

from .. import contracts, domain, validate
from .edge import Handlers, strict


class Interactions(Handlers):
    @strict
    async def RegisterInteractionConfirmation(
        self, request: authz_pb2.RegisterInteractionConfirmationRequest
    ) -> authz_pb2.InteractionConfirmationResponse:
        agent_id = validate.agent_uuid(request.agent_id, contract=True)
        confirmation_id = validate.opaque_id(request.confirmation_id, "confirmation_id", contract=True)
        digest = contracts.interaction_action(request.action_json)
        ttl_ms = validate.ttl_ms(
            request.ttl_ms or domain.DEFAULT_INTERACTION_TTL_MS,
            "ttl_ms",
            maximum=domain.MAX_INTERACTION_TTL_MS,
        )
        stored = await self.store.register_interaction(agent_id, confirmation_id, digest, ttl_ms)
        if stored is None:  # a concurrent registration of the same id just committed
            confirmation = await self.store.get_interaction(agent_id, confirmation_id)
            assert confirmation is not None  # confirmations are never deleted
            stored = (confirmation, False)
        confirmation, created = stored
        if not created:
            domain.check_registered_again(confirmation, digest)
        return authz_pb2.InteractionConfirmationResponse(
            confirmation=confirmation.to_proto(), created=created
        )

    @strict
    async def IssueInteractionConfirmation(
        self, request: authz_pb2.IssueInteractionConfirmationRequest
    ) -> authz_pb2.InteractionConfirmationResponse:
        agent_id = validate.agent_uuid(request.agent_id, contract=True)
        confirmation_id = validate.opaque_id(request.confirmation_id, "confirmation_id", contract=True)
        digest = validate.hex_digest(request.action_digest, "action_digest")
        issued = await self.store.issue_interaction(agent_id, confirmation_id, digest, uuid.uuid4().hex)
        if issued is None:
            raise domain.why_not_issued_interaction(
                await self.store.get_interaction(agent_id, confirmation_id), digest
            )
        return authz_pb2.InteractionConfirmationResponse(confirmation=issued.to_proto())

    @strict
    async def ConsumeInteractionConfirmation(
        self, request: authz_pb2.ConsumeInteractionConfirmationRequest
    ) -> authz_pb2.InteractionConfirmationResponse:
        agent_id = validate.agent_uuid(request.agent_id, contract=True)
        confirmation_id = validate.opaque_id(request.confirmation_id, "confirmation_id", contract=True)
        grant_id = validate.opaque_id(request.grant_id, "grant_id", contract=True)
        digest = contracts.interaction_action(request.action_json)
        consumption = await self.store.consume_interaction(agent_id, confirmation_id, grant_id, digest)
        if consumption.consumed is None:
            error = domain.why_not_consumed_interaction(consumption.seen, grant_id, digest)
            self.metrics.decisions.labels("interaction", error.code.lower()).inc()
            raise error
        self.metrics.decisions.labels("interaction", "consumed").inc()
        return authz_pb2.InteractionConfirmationResponse(confirmation=consumption.consumed.to_proto())
