"""The ``parley.v1.CustomActions`` service, served over gRPC and NATS beside ``Runtime``."""

from __future__ import annotations

import json

from parley.v1 import actions_pb2
from parley_platform.convert import timestamp

from .. import errors
from ..custom.definitions import parse_definition_text
from .custom_actions import CustomActionRegistry, Listed, try_definition
from .directory import AgentDirectory, AgentInfo

MAX_PARAMS_CHARS = 256_000


def _message(agent: AgentInfo, listed: Listed) -> actions_pb2.CustomAction:
    d = listed.definition
    return actions_pb2.CustomAction(
        id=d.id,
        agent_id=str(agent.id),
        name=d.name,
        description=d.description,
        similes=d.similes,
        handler_type=d.handler.type,
        enabled=d.enabled,
        source=listed.source,
        definition_json=json.dumps(d.public_document(), sort_keys=True),
        created_at=timestamp(d.created_at),
        updated_at=timestamp(d.updated_at),
    )


class CustomActionsApi:
    def __init__(self, directory: AgentDirectory, registry: CustomActionRegistry) -> None:
        self.directory = directory
        self.registry = registry

    async def _agent(self, ref: str) -> AgentInfo:
        agent = await self.directory.require(ref)
        return await self.registry.refresh(agent.id) or agent

    async def AddCustomAction(self, request: actions_pb2.AddCustomActionRequest) -> actions_pb2.CustomAction:
        agent = await self._agent(request.agent_id)
        definition = parse_definition_text(request.definition, "definition")
        return _message(agent, await self.registry.add(agent, definition))

    async def ListCustomActions(
        self, request: actions_pb2.ListCustomActionsRequest
    ) -> actions_pb2.ListCustomActionsResponse:
        agent = await self._agent(request.agent_id)
        listed = sorted(self.registry.definitions(agent), key=lambda item: item.definition.name)
        return actions_pb2.ListCustomActionsResponse(actions=[_message(agent, item) for item in listed])

    async def TestCustomAction(
        self, request: actions_pb2.TestCustomActionRequest
    ) -> actions_pb2.TestCustomActionResponse:
        params = _params(request.params_json)
        if request.definition.strip() and request.id:
            raise errors.DEFINITION_OR_ID("give either definition or id, not both")
        if request.definition.strip():
            definition = parse_definition_text(request.definition, "definition")
            agent = await self._agent(request.agent_id) if request.agent_id else None
        elif request.id:
            agent = await self._agent(request.agent_id)
            found = [d.definition for d in self.registry.definitions(agent) if d.definition.id == request.id]
            if not found:
                raise errors.CUSTOM_ACTION_NOT_FOUND(
                    f"id: agent {agent.character.name!r} has no custom action {request.id[:128]!r}"
                )
            definition = found[0]
        else:
            raise errors.DEFINITION_REQUIRED(
                "definition or id is required (a definition to run, or a registered action's id)"
            )
        result = await try_definition(
            self.registry.executor, definition, params, agent.setting if agent is not None else None
        )
        output = agent.redactor.redact(result.output) if agent is not None else result.output
        return actions_pb2.TestCustomActionResponse(ok=result.ok, output=output)

    async def RemoveCustomAction(
        self, request: actions_pb2.RemoveCustomActionRequest
    ) -> actions_pb2.RemoveCustomActionResponse:
        agent = await self._agent(request.agent_id)
        if not request.id:
            raise errors.ID_REQUIRED("id is required (the custom action's id)")
        await self.registry.remove(agent, request.id)
        return actions_pb2.RemoveCustomActionResponse()


def _params(text: str) -> dict[str, object]:
    if not text.strip():
        return {}
    if len(text) > MAX_PARAMS_CHARS:
        raise errors.PARAMS_TOO_LARGE("params_json is over 256 kB")
    try:
        value = json.loads(text)
    except ValueError:
        raise errors.PARAMS_INVALID("params_json is not valid JSON") from None
    if not isinstance(value, dict):
        raise errors.PARAMS_INVALID("params_json must be a JSON object")
    return value
