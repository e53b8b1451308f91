"""The connector methods of ``parley.v1.Pairing``: operators create, list and revoke connectors.
No service identity may call them over NATS (parley_platform.permissions), except
ConnectorByApiKey, with which the web service checks the API keys its clients present."""

from __future__ import annotations

from parley.v1 import pairing_pb2
from parley_platform import permissions
from parley_platform.convert import timestamp, uuid_of

from . import errors
from .callout import Kicker
from .connectors import Connector, check_kind, check_name, check_source, digest, new_secret
from .store import ConnectorStore

API_KEY_DIGEST_BYTES = 32


def connector_pb(connector: Connector) -> pairing_pb2.Connector:
    return pairing_pb2.Connector(
        name=connector.name,
        agent_id=str(connector.agent_id),
        source=connector.source,
        kind=connector.kind,
        namespace=connector.namespace,
        created_at=timestamp(connector.created_at),
        revoked_at=timestamp(connector.revoked_at),
    )


class ConnectorsApi:
    def __init__(self, store: ConnectorStore, kicker: Kicker, namespace: str) -> None:
        self.store = store
        self.kicker = kicker
        self.namespace = namespace

    async def AddConnector(
        self, request: pairing_pb2.AddConnectorRequest
    ) -> pairing_pb2.AddConnectorResponse:
        name = check_name(request.name)
        agent_id = uuid_of(request.agent_id, "agent_id")
        source = check_source(request.source)
        kind = check_kind(request.kind)
        if kind == "web" and source != permissions.WEB_SOURCE:
            raise errors.INVALID_SOURCE(f"a web connector's source is {permissions.WEB_SOURCE!r}")
        password = new_secret()
        api_key = new_secret() if kind == "web" else ""
        connector = await self.store.add(
            name=name,
            namespace=self.namespace,
            agent_id=agent_id,
            source=source,
            kind=kind,
            secret=digest(password),
            api_key=digest(api_key) if api_key else None,
        )
        if connector is None:
            raise errors.CONNECTOR_EXISTS(f"a connector named {name!r} exists")
        return pairing_pb2.AddConnectorResponse(
            connector=connector_pb(connector), password=password, api_key=api_key
        )

    async def ListConnectors(
        self, request: pairing_pb2.ListConnectorsRequest
    ) -> pairing_pb2.ListConnectorsResponse:
        agent_id = uuid_of(request.agent_id, "agent_id") if request.agent_id else None
        found = await self.store.find(self.namespace, agent_id, request.include_revoked)
        return pairing_pb2.ListConnectorsResponse(connectors=[connector_pb(c) for c in found])

    async def RevokeConnector(
        self, request: pairing_pb2.RevokeConnectorRequest
    ) -> pairing_pb2.RevokeConnectorResponse:
        name = check_name(request.name)
        revoked = await self.store.revoke(self.namespace, name)
        if revoked is None:
            raise errors.CONNECTOR_NOT_FOUND(f"no connector {name!r} that may still connect")
        connector, sessions = revoked
        closed = await self.kicker.close(sessions)
        return pairing_pb2.RevokeConnectorResponse(
            connector=connector_pb(connector), connections_closed=closed
        )

    async def ConnectorByApiKey(
        self, request: pairing_pb2.ConnectorByApiKeyRequest
    ) -> pairing_pb2.ConnectorByApiKeyResponse:
        if len(request.api_key_digest) != API_KEY_DIGEST_BYTES:
            raise errors.INVALID_API_KEY_DIGEST("api_key_digest must be the 32 bytes of a SHA-256 digest")
        found = await self.store.by_api_key(request.api_key_digest)
        if found is None or found.namespace != self.namespace or found.kind != "web":
            raise errors.CONNECTOR_NOT_FOUND("no web connector with that API key that may still connect")
        return pairing_pb2.ConnectorByApiKeyResponse(connector=connector_pb(found))
