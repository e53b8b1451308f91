"""Who may publish and subscribe to what on the bus: every identity's NATS permissions, in one place.

Each service connects as its own NATS user; the operator (the CLI, an operator's tools) as
``operator``; connectors as users the pairing service admits through NATS auth callout, with the
permissions ``connector`` returns (their own agent's inbound subject for their own source, the
replies and stream chunks for that source, their own durable consumer). Nothing connects
anonymously. The server configuration is rendered from this module (``server_authorization``):
``make run`` and the tests write it with generated passwords, ``deploy/nats.conf`` with
environment references.

Subjects start with the namespace (``parley`` in production; test sessions use their own), so the
services' permissions wildcard its token; a connector's are exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ACCOUNT = "PARLEY"  # the account of every service, the operator and every connector
SYSTEM_ACCOUNT = "SYS"  # NATS' own account; its user kicks revoked connectors
SYSTEM_USER = "system"
AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"  # where the server asks the callout service about a connection
NS = "*"  # any namespace

JS_API = "$JS.API.>"
JS_ACK = "$JS.ACK.>"
MAX_DELIVERIES = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>"


def inbox_prefix(identity: str) -> str:
    """Each identity receives replies under its own prefix, so no one can read another's replies."""
    return f"_INBOX.{identity}"


def rpc(service: str, *methods: str) -> list[str]:
    return [f"{NS}.{service}.{method}" for method in methods]


def stream_control(service: str) -> str:
    """Where a caller of the service's streamed methods pings or cancels its streams
    (``parley_platform.rpcstream``)."""
    return f"{NS}.{service}.stream.*"


def stream_inbox(identity: str) -> str:
    """Where the items of the identity's streamed calls arrive: a part of its inbox that the servers
    of those calls may publish to, without reaching its other replies."""
    return f"{inbox_prefix(identity)}.stream.>"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    # How many times it may answer each request it received (on the request's reply subject),
    # without a publish permission on it: 0 never, 1 once.
    responses: int = 0

    def to_config(self) -> dict[str, object]:
        config: dict[str, object] = {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }
        if self.responses == 1:
            config["allow_responses"] = True
        elif self.responses > 1:
            config["allow_responses"] = {"max": self.responses}
        return config


@dataclass(frozen=True)
class Identity:
    name: str
    permissions: Permissions
    description: str = ""
    calls: tuple[str, ...] = field(default=())  # the other services' RPCs it calls, for the docs


def _service(
    name: str,
    *,
    serves: str,
    publish: Iterable[str] = (),
    subscribe: Iterable[str] = (),
    responses: int = 1,
) -> Permissions:
    return Permissions(
        publish=tuple(publish),
        subscribe=(f"{NS}.{serves}.>", f"{inbox_prefix(name)}.>", *subscribe),
        responses=responses,
    )


# The most runs the scheduler sends a worker in one request (``parley_platform.worker``): a
# service that hosts workers answers each request up to this many times, a batch's runs as they end.
MAX_BATCH_RUNS = 64


WORKER_HEARTBEAT = f"{NS}.scheduler.heartbeat.*"
WEB_SOURCE = "web"  # the source of every message the web service publishes
WEB_DURABLE = "web"  # the web service's durable consumer on OUTBOUND, filtered to its source
REGISTER_WORKER = f"{NS}.scheduler.RegisterWorker"

IDENTITIES: dict[str, Identity] = {
    "runtime": Identity(
        "runtime",
        _service(
            "runtime",
            serves="runtime",
            publish=[
                f"{NS}.inbound.>",
                f"{NS}.self.>",
                f"{NS}.outbound.>",
                f"{NS}.stream.>",
                f"{NS}.events.>",
                f"{NS}.dead.>",
                f"{NS}.runtime.agents.changed",
                f"{NS}.runtime.turns.cancel",
                f"{NS}.runtime.rooms.taken",
                *rpc(
                    "model", "Generate", "GenerateStream", "Embed", "AddSection", "Drain", "DisposeSections"
                ),
                stream_control("model"),
                *rpc(
                    "authz",
                    "PutPending",
                    "ListPendingToolCalls",
                    "Decide",
                    "Settle",
                    "ListMessageToolCalls",
                    "AcquireLease",
                    "RenewLease",
                    "ReleaseLease",
                    "BindCapabilityRequest",
                    "RegisterDecision",
                    "Authorize",
                    "RecordReceipt",
                ),
                *rpc("pairing", "IsAllowed", "UpsertRequest", "ClaimPairingReply"),
                *rpc("scheduler", "CreateTask"),
                REGISTER_WORKER,
                WORKER_HEARTBEAT,
                JS_API,
                JS_ACK,
            ],
            subscribe=[
                f"{NS}.outbound.*.api",
                f"{NS}.cancel.>",
                f"{NS}.tasks.run.RUNTIME_EMBED_BACKFILL",
                f"{NS}.model.batcher.result.>",
                MAX_DELIVERIES,
            ],
            responses=MAX_BATCH_RUNS,
        ),
        "agent turns: consumes inbound messages, publishes replies and events, calls the others",
    ),
    "model": Identity(
        "model",
        _service(
            "model",
            serves="model",
            publish=[
                f"{NS}.model.batcher.result.>",
                f"{NS}.model.budget.changed",
                stream_inbox("runtime"),
                stream_inbox("operator"),
                *rpc("scheduler", "CreateTask", "ResumeTask"),
                REGISTER_WORKER,
                WORKER_HEARTBEAT,
            ],
            subscribe=[f"{NS}.tasks.run.BATCHER_DRAIN"],
            responses=MAX_BATCH_RUNS,
        ),
        "the model gateway: serves model calls, runs the batcher's drains",
    ),
    "scheduler": Identity(
        "scheduler",
        _service("scheduler", serves="scheduler", publish=[f"{NS}.tasks.run.>"]),
        "the scheduler: dispatches due tasks to the services' workers",
    ),
    "authz": Identity(
        "authz",
        _service("authz", serves="authz", publish=[f"{NS}.events.>", f"{NS}.dead.>", JS_API, JS_ACK]),
        "authz: serves decisions, publishes tool-call events",
    ),
    "pairing": Identity(
        "pairing",
        _service("pairing", serves="pairing", subscribe=[AUTH_SUBJECT]),
        "pairing: serves pairing and connectors, and admits connectors to NATS (auth callout)",
    ),
    "web": Identity(
        "web",
        _service(
            "web",
            serves="web",
            publish=[
                f"{NS}.inbound.*.{WEB_SOURCE}",
                f"{NS}.cancel.*.{WEB_SOURCE}",
                *rpc("pairing", "ConnectorByApiKey"),
                *rpc("runtime", "ListAgents", "ListMemories"),
                # Its own durable consumer on OUTBOUND (any namespace's stream: a stream name is one
                # token), created only with the filter of the web source's replies.
                f"$JS.API.CONSUMER.CREATE.*.{WEB_DURABLE}.{NS}.outbound.*.{WEB_SOURCE}",
                f"$JS.API.CONSUMER.INFO.*.{WEB_DURABLE}",
                f"$JS.API.CONSUMER.MSG.NEXT.*.{WEB_DURABLE}",
                f"$JS.ACK.*.{WEB_DURABLE}.>",
            ],
            subscribe=[f"{NS}.stream.*.{WEB_SOURCE}"],
        ),
        "the web connector: the chat page and the OpenAI-compatible API; publishes its users' "
        "messages for source web, reads their replies through its own durable consumer",
    ),
    # The operator's tools (the CLI, its terminal chat, the tests' clients) may do anything.
    "operator": Identity("operator", Permissions(publish=(">",), subscribe=(">",)), "the operator's tools"),
}
SERVICES = ("runtime", "model", "scheduler", "authz", "pairing", "web")


def connector_durable(name: str) -> str:
    """The durable consumer a connector reads its replies with."""
    return f"connector-{name}"


def connector(namespace: str, agent_id: str, source: str, name: str) -> Permissions:
    """What a connector may do: publish its agent's inbound messages for its own source; read that
    agent's replies for that source through its own durable consumer (created with exactly that
    filter); receive that source's stream chunks; cancel that source's turns."""
    outbound_stream = f"{namespace.upper()}_OUTBOUND"
    durable = connector_durable(name)
    outbound = f"{namespace}.outbound.{agent_id}.{source}"
    return Permissions(
        publish=(
            f"{namespace}.inbound.{agent_id}.{source}",
            f"{namespace}.cancel.{agent_id}.{source}",
            f"$JS.API.CONSUMER.CREATE.{outbound_stream}.{durable}.{outbound}",
            f"$JS.API.CONSUMER.INFO.{outbound_stream}.{durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.{outbound_stream}.{durable}",
            f"$JS.ACK.{outbound_stream}.{durable}.>",
        ),
        subscribe=(f"{inbox_prefix('connector')}.{name}.>", f"{namespace}.stream.{agent_id}.{source}"),
    )


def connector_inbox(name: str) -> str:
    return f"{inbox_prefix('connector')}.{name}"


def _hocon(value: object) -> str:
    """NATS' configuration format takes JSON values."""
    return json.dumps(value)


def server_authorization(passwords: Mapping[str, str], *, system_password: str, callout_issuer: str) -> str:
    """The accounts and authorization blocks of the NATS server configuration.

    ``passwords`` maps each identity of ``IDENTITIES`` to its password, or to an environment
    reference such as ``$PARLEY_RUNTIME_NATS_PASSWORD``, written as is for the server to resolve.
    Every configured user bypasses the callout; anyone else (a connector) is admitted, or not, by
    the pairing service."""

    def password(value: str) -> str:
        """An environment reference (``$NAME``) is written bare, for the server to resolve."""
        return value if value.startswith("$") else _hocon(value)

    users = []
    for name, identity in IDENTITIES.items():
        users.append(
            f"      {{user: {_hocon(name)}, password: {password(passwords[name])}, "
            f"permissions: {_hocon(identity.permissions.to_config())}}}"
        )
    bypass = [*IDENTITIES, SYSTEM_USER]
    return "\n".join(
        [
            "accounts {",
            f"  {ACCOUNT} {{",
            "    jetstream: enabled",
            "    users: [",
            *users,
            "    ]",
            "  }",
            f"  {SYSTEM_ACCOUNT} {{",
            f"    users: [{{user: {_hocon(SYSTEM_USER)}, password: {password(system_password)}}}]",
            "  }",
            "}",
            f"system_account: {SYSTEM_ACCOUNT}",
            "authorization {",
            "  auth_callout {",
            f"    issuer: {password(callout_issuer)}",
            f"    account: {ACCOUNT}",
            f"    auth_users: {_hocon(bypass)}",
            "  }",
            "}",
            "",
        ]
    )
