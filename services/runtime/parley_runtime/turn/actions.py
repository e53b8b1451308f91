"""Running one planned action, in the spec's order: lookup (name or simile) → permission (private,
roles) → validate() → parameters (planner's, else one extraction call) → schema → confirmation
(asked for, not run) → effect claim for non-idempotent actions → the handler."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from parley_platform.logging import get_logger

from ..agents.directory import AgentInfo
from ..plugins.arguments import resolve_action_args, schema_errors
from ..plugins.catalog import permission_error
from ..sdk import Action, ActionResult, Callback, Content, TurnContext
from ..store import RuntimeStore
from .approvals import needs_confirmation
from .capabilities import CapabilityGate
from .ports import Events, Model
from .prompt import Segment
from .state import Proposal, Turn, TurnMetrics

log = get_logger(__name__)


async def invoke(
    agent: AgentInfo,
    action: Action,
    ctx: TurnContext,
    params: Mapping[str, Any],
    callback: Callback,
    *,
    gate: CapabilityGate | None = None,
    decision_id: str = "",
) -> tuple[ActionResult, str]:
    """Run a handler: its exception is a failed result (``error``), never a failed turn. An action
    with a capability runs only once authz authorized this run (``gate``, ``decision_id``)."""

    async def call() -> tuple[ActionResult, str]:
        try:
            result = await action.handler(ctx, dict(params), callback) or ActionResult(True)
            return result, "success" if result.success else "failed"
        except Exception as exc:
            # No traceback: a handler's locals and messages may hold the agent's secrets.
            error = agent.redactor.redact(f"{type(exc).__name__}: {exc}")
            log.error("action handler raised", action=action.name, agent_id=str(agent.id), error=error)
            return ActionResult(False, error=error), "error"

    if action.capability is None:
        return await call()
    if gate is None or not decision_id:
        return ActionResult(False, error="CAPABILITY_NOT_CONFIGURED: no capability authorization here"), (
            "unauthorized"
        )
    return await gate.run(agent, action, params, decision_id, call)


UNCERTAIN = ActionResult(
    False,
    error="UNCERTAIN_EFFECT: a previous attempt started this action and did not record a result; it is "
    "not run again",
)


class ActionRunner:
    def __init__(
        self,
        *,
        store: RuntimeStore,
        model: Model,
        events: Events,
        metrics: TurnMetrics,
        capabilities: CapabilityGate | None = None,
    ) -> None:
        self.capabilities = capabilities
        self.store = store
        self.model = model
        self.events = events
        self.metrics = metrics

    async def run(self, turn: Turn, index: int, name: str) -> None:
        agent, ctx = turn.agent, turn.ctx
        record: dict[str, Any] = {"index": index, "name": name}
        turn.trajectory["actions"].append(record)
        action = agent.catalog.find(name)
        if action is None:
            self._record(turn, record, "unknown", ActionResult(False, error=f"UNKNOWN_ACTION: {name}"))
            return
        record["name"] = action.name
        refusal = permission_error(action, ctx)
        if refusal is not None:
            self._record(turn, record, "rejected", ActionResult(False, error=refusal))
            return
        if action.validate is not None and not await action.validate(ctx):
            self._record(
                turn, record, "skipped", ActionResult(False, error=f"{action.name} is not valid here")
            )
            return
        planner = (ctx.parsed.action_params.get(action.name) if ctx.parsed else None) or {}
        resolution = await resolve_action_args(
            action,
            planner,
            extract=lambda prompt: self.model.generate(
                agent.id, [Segment(prompt, False)], small=True, structured=True
            ),
            intent=ctx.message.text,
            recent=[f"{h.name}: {h.text}" for h in ctx.history],
        )
        record["params"] = resolution.params
        if resolution.extraction_calls:
            record["extraction_calls"] = resolution.extraction_calls
        if resolution.missing:
            missing = ", ".join(resolution.missing)
            self._record(turn, record, "failed", ActionResult(False, error=f"missing: [{missing}]"))
            return
        if resolution.clarification:
            turn.replies.append(Content(text=resolution.clarification, actions=(action.name,)))
            self._record(turn, record, "clarify", ActionResult(False, error="CLARIFICATION_NEEDED"))
            return
        errors = schema_errors(action, resolution.params)
        if errors:
            self._record(turn, record, "invalid", ActionResult(False, error="; ".join(errors)))
            return
        if needs_confirmation(agent, action) and not ctx.is_autonomous:
            turn.proposals.append(Proposal(index, action, dict(resolution.params)))
            self._record(
                turn, record, "pending", ActionResult(False, error="AWAITING_CONFIRMATION: asked the user")
            )
            return
        if not action.idempotent and not await self.store.claim_effect(agent.id, turn.id, index, action.name):
            effect = await self.store.get_effect(agent.id, turn.id, index)
            if effect is not None and effect.result is not None:
                self._record(turn, record, "replayed", ActionResult.from_json(effect.result))
            else:
                self._record(turn, record, "uncertain", UNCERTAIN)
            return
        await self.events.emit(agent, "ACTION_STARTED", turn.id, turn.room_id, action=action.name)

        async def callback(content: Content) -> None:
            turn.replies.append(content)

        result, outcome = await invoke(
            agent,
            action,
            ctx,
            resolution.params,
            callback,
            gate=self.capabilities,
            decision_id=f"turn:{turn.id}:{index}:{turn.ingested.attempts}",
        )
        if not action.idempotent:
            await self.store.complete_effect(
                agent.id, turn.id, index, agent.redactor.redact_obj(result.to_json())
            )
        self._record(turn, record, outcome, result)
        await self.events.emit(
            agent, "ACTION_COMPLETED", turn.id, turn.room_id, action=action.name, outcome=outcome
        )

    def _record(self, turn: Turn, record: dict[str, Any], outcome: str, result: ActionResult) -> None:
        record["outcome"] = outcome
        record["result"] = result.to_json()
        turn.ctx.results.append(result)
        known = turn.agent.catalog.find(record["name"]) is not None
        self.metrics.actions.labels(record["name"] if known else "unknown", outcome).inc()
