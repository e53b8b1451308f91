"""Shared test types and helpers: the session's environment, the suite of service processes, the
runtime's store against a real PostgreSQL, and the plans PostgreSQL ran."""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import nats.js.errors
import psycopg
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from psycopg import sql as pgsql
from psycopg.adapt import PyFormat, Transformer

from parley.v1 import runtime_pb2
from parley_devinfra.infra import Endpoints, free_port
from parley_devinfra.natsauth import NatsAuth
from parley_platform.bus import Bus
from parley_platform.postgres import Database, migrate
from parley_platform.testing import ServiceProcess
from parley_runtime.records import NewMessage
from parley_runtime.store import MIGRATIONS_DIR as RUNTIME_MIGRATIONS
from parley_runtime.store import SCHEMA as RUNTIME_SCHEMA
from parley_runtime.store import RuntimeStore, positional

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class SessionEnv:
    nats_url: str  # with the operator's credentials: what the tests' own clients connect as
    server_database_url: str  # the server's own database, for creating others
    database_url: str  # this session's database
    namespace: str
    token: str
    endpoints: Endpoints

    def url_for(self, identity: str) -> str:
        """The NATS URL with another identity's credentials (a service, the operator)."""
        return self.endpoints.nats_url_for(identity)

    def service_env(self, **extra: str) -> dict[str, str]:
        """A service process's environment: each service picks its own NATS password from it."""
        assert self.endpoints.nats_auth is not None, "the test NATS server is configured by the session"
        env = {
            **self.endpoints.nats_auth.services_env(),
            "PARLEY_NATS_URL": self.endpoints.nats_url,
            "PARLEY_DATABASE_URL": self.database_url,
            "PARLEY_NAMESPACE": self.namespace,
            "PARLEY_OPERATOR_TOKEN": self.token,
            "PARLEY_ENVIRONMENT": "test",
            "PARLEY_MODEL_PROVIDER": "scripted",
            "PARLEY_CHARACTERS_DIR": str(ROOT / "characters"),
            "PARLEY_SCRIPTED_RULES": str(ROOT / "tests" / "e2e" / "rules.yaml"),
        }
        env.update(extra)
        return env


def cluster_env(env: SessionEnv, nats_url: str, auth: NatsAuth) -> SessionEnv:
    """``env`` on another NATS deployment (a cluster: ``nats_url`` lists its nodes), in a namespace of
    its own; the database and the operator token stay the session's."""
    endpoints = replace(env.endpoints, nats_url=nats_url, nats_auth=auth, nats_monitor_url=None)
    return replace(
        env,
        nats_url=endpoints.nats_url_for("operator"),
        namespace=f"c{secrets.token_hex(4)}",
        endpoints=endpoints,
    )


@dataclass
class Suite:
    """The model gateway and runtime replicas as real processes, in one NATS namespace."""

    env: SessionEnv
    logs: Path
    namespace: str
    gateway: ServiceProcess | None = None
    runtimes: list[ServiceProcess] = field(default_factory=list)
    others: list[ServiceProcess] = field(default_factory=list)
    common_env: dict[str, str] = field(default_factory=dict)  # given to every process of the suite

    def _env(self, **extra: str) -> dict[str, str]:
        return self.env.service_env(PARLEY_NAMESPACE=self.namespace, **{**self.common_env, **extra})

    def gateway_process(self, **extra: str) -> ServiceProcess:
        port = free_port()
        env = self._env(
            PARLEY_GATEWAY_GRPC_PORT=str(port), PARLEY_GATEWAY_METRICS_PORT=str(free_port()), **extra
        )
        return ServiceProcess("parley_gateway", env, self.logs / f"gateway-{port}.log", port)

    async def add_service(self, module: str, key: str, **extra: str) -> ServiceProcess:
        """Another service of the suite (``parley_pairing``, ``PAIRING``, ...), started and ready."""
        port = free_port()
        env = self._env(
            **{f"PARLEY_{key}_GRPC_PORT": str(port), f"PARLEY_{key}_METRICS_PORT": str(free_port())}, **extra
        )
        process = ServiceProcess(module, env, self.logs / f"{module}-{port}.log", port).start()
        self.others.append(process)
        await process.wait_ready()
        return process

    def runtime_process(self, **extra: str) -> ServiceProcess:
        port = free_port()
        env = self._env(
            PARLEY_RUNTIME_GRPC_PORT=str(port), PARLEY_RUNTIME_METRICS_PORT=str(free_port()), **extra
        )
        return ServiceProcess("parley_runtime", env, self.logs / f"runtime-{port}.log", port)

    async def start(self, runtimes: int = 1, **runtime_env: str) -> Suite:
        self.gateway = self.gateway_process().start()
        await self.gateway.wait_ready()
        for _ in range(runtimes):
            await self.add_runtime(**runtime_env)
        return self

    async def add_runtime(self, **runtime_env: str) -> ServiceProcess:
        process = self.runtime_process(**runtime_env).start()
        self.runtimes.append(process)
        await process.wait_ready()
        return process

    def stop(self) -> None:
        for process in [*self.runtimes, *self.others]:
            process.stop()
        if self.gateway:
            self.gateway.stop()

    @property
    def runtime(self) -> ServiceProcess:
        return self.runtimes[0]

    async def connect(self) -> Bus:
        return await Bus.connect(self.env.nats_url, name="tests", namespace=self.namespace)


AGENT_NAMESPACE = uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579")
DEFAULT_AGENT_ID = str(uuid.uuid5(AGENT_NAMESPACE, "agent:default"))


def inbound(
    text: str,
    *,
    message_id: str | None = None,
    channel: str | None = None,
    source: str = "e2e",
    sender: str = "alice",
    agent_id: str = DEFAULT_AGENT_ID,
    room_type: int = runtime_pb2.ROOM_TYPE_DM,
) -> runtime_pb2.InboundMessage:
    return runtime_pb2.InboundMessage(
        agent_id=agent_id,
        source=source,
        message_id=message_id or uuid.uuid4().hex,
        sender_id=sender,
        sender_name=sender.title(),
        # A room of its own by default: rooms are shared by every stream of the session's database,
        # and the turn lease orders messages by stream sequence (see the runtime issue's note).
        channel_id=channel or f"e2e-{uuid.uuid4().hex[:8]}",
        room_type=room_type,  # type: ignore[arg-type]
        text=text,
    )


async def publish_inbound(bus: Bus, message: runtime_pb2.InboundMessage, msg_id: str | None = None) -> None:
    await bus.publish(
        # A message without a source (a poison case) still needs a subject: the runtime refuses it.
        bus.subjects.inbound(message.agent_id, message.source or "none"),
        message.SerializeToString(),
        msg_id=msg_id or f"{message.source}:{message.message_id}",
    )


async def stream_messages(bus: Bus, subject: str) -> list[Msg]:
    """Every message stored on ``subject`` so far, read from the stream (not a live subscription)."""
    stream = await bus.js.find_stream_name_by_subject(subject)
    try:
        last = (await bus.js.get_last_msg(stream, subject)).seq
    except nats.js.errors.NotFoundError:
        return []
    sub = await bus.js.subscribe(
        subject, ordered_consumer=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    )
    found: list[Msg] = []
    try:
        while not found or found[-1].metadata.sequence.stream < last:
            found.append(await sub.next_msg(timeout=5))
    finally:
        await sub.unsubscribe()
    return found


async def replies_to(bus: Bus, message: runtime_pb2.InboundMessage) -> list[runtime_pb2.OutboundMessage]:
    msgs = await stream_messages(bus, bus.subjects.outbound(message.agent_id, message.source))
    replies = [runtime_pb2.OutboundMessage.FromString(m.data) for m in msgs]
    return [r for r in replies if r.in_reply_to == message.message_id]


async def inbound_settled(bus: Bus) -> bool:
    """True when the runtime's durable consumer has nothing pending and nothing awaiting an ack."""
    info = await bus.js.consumer_info(bus.subjects.stream("INBOUND"), "runtime")
    return info.num_pending == 0 and info.num_ack_pending == 0


def turn_of(database_url: str, message: runtime_pb2.InboundMessage) -> tuple[str, int] | None:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT t.state, t.attempts FROM runtime.turn t JOIN runtime.memory m"
            " ON m.agent_id = t.agent_id AND m.id = t.id"
            " WHERE m.source = %s AND m.external_id = %s",
            (message.source, message.message_id),
        ).fetchone()
    return None if row is None else (row[0], row[1])


def scraped(port: str | int, name: str, label: str = "") -> float:
    """The sum of a metric's samples whose labels contain ``label``, scraped from a service's
    metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = re.findall(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M)
    return sum(float(value) for labels, value in samples if label in labels)


@contextlib.asynccontextmanager
async def migrated(
    database_url: str, schema: str, migrations: Path, name: str, *, max_size: int = 4
) -> AsyncIterator[Database]:
    """A pool on ``database_url`` with a service's migrations applied, closed on the way out."""
    await migrate(database_url, schema, migrations)
    database = Database(database_url, name=name, min_size=1, max_size=max_size)
    await database.open()
    try:
        yield database
    finally:
        await database.close()


@contextlib.asynccontextmanager
async def runtime_store(database_url: str, name: str, *, max_size: int = 4) -> AsyncIterator[RuntimeStore]:
    """The runtime's store on a migrated database."""
    async with migrated(
        database_url, RUNTIME_SCHEMA, RUNTIME_MIGRATIONS, name, max_size=max_size
    ) as database:
        yield RuntimeStore(database)


async def new_agent(store: RuntimeStore) -> uuid.UUID:
    agent_id = uuid.uuid4()
    await store.upsert_agent(agent_id, f"agent-{agent_id.hex[:8]}", {"name": "x"}, True)
    return agent_id


def new_message(
    agent_id: uuid.UUID,
    room_id: uuid.UUID,
    seq: int,
    text: str | None = None,
    *,
    sender: uuid.UUID | None = None,
    source: str = "test",
    history: int = 4,
) -> NewMessage:
    """Message ``seq`` of a DM room as the runtime's ingest takes it; by default its sender is the
    agent's one user, the same in every room."""
    return NewMessage(
        agent_id=agent_id,
        world_id=None,
        world_external_id=None,
        source=source,
        entity_id=sender or uuid.uuid5(agent_id, "user"),
        entity_names=["user"],
        entity_metadata={},
        room_id=room_id,
        channel_id=f"channel-{room_id.hex[:8]}",
        room_type="DM",
        stream_epoch=1,
        stream_seq=seq,
        memory_id=uuid.uuid5(room_id, str(seq)),
        content={"text": f"message {seq}" if text is None else text},
        external_id=f"{room_id.hex}-{seq}",
        history=history,
        sender_role=None,
        reply_to_id=None,
    )


async def explain(
    db: Database, sql: str, values: Mapping[str, Any] | None = None, *, plan_cache_mode: str | None = None
) -> dict[str, Any]:
    """The plan of ``sql`` as PostgreSQL ran it (``EXPLAIN ANALYZE``, in a transaction rolled back).

    With ``plan_cache_mode``, the statement is prepared and executed as the services' statements
    are (psycopg prepares them on the server), so ``force_generic_plan`` gives the generic plan
    PostgreSQL's plan cache may switch to after five executions. A plain ``EXPLAIN`` of a statement
    with parameters always plans for their values: the plan cache never sees it. That path takes
    ``%(name)s`` placeholders only (no ``%%``, no ``%(name)b``) and values psycopg can write as SQL
    literals (not ``Vector``, which has a binary form only)."""
    async with db.connection("explain") as conn:
        if plan_cache_mode is None:
            async with conn.transaction(force_rollback=True):
                cursor = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, values)
                row = await cursor.fetchone()
        else:
            row = await _explain_prepared(conn, sql, values or {}, plan_cache_mode)
    assert row is not None
    document = row[0] if not isinstance(row, dict) else next(iter(row.values()))
    plan: dict[str, Any] = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
    return plan


async def _explain_prepared(
    conn: psycopg.AsyncConnection[Any], sql: str, values: Mapping[str, Any], plan_cache_mode: str
) -> Any:
    text, names = positional(sql)
    arguments = [values[name] for name in names]
    # The parameters' types as psycopg sends them (unknown where it leaves them to the server).
    adapter = Transformer(conn)
    adapter.dump_sequence(arguments, [PyFormat.AUTO] * len(arguments))
    name = f"explained_{uuid.uuid4().hex}"
    try:
        async with conn.transaction(force_rollback=True):
            cursor = await conn.execute(
                "SELECT CASE WHEN o = 0 THEN 'unknown' ELSE format_type(o, NULL) END"
                "  FROM unnest(%s::oid[]) WITH ORDINALITY AS p (o, i) ORDER BY i",
                (list(adapter.types),),
            )
            declared = ", ".join(str(r[0]) for r in await cursor.fetchall())
            await conn.execute("SELECT set_config('plan_cache_mode', %s, true)", (plan_cache_mode,))
            await conn.execute(f"PREPARE {name} ({declared}) AS {text}".encode())
            # EXECUTE takes its arguments as literals: a utility statement has no bound parameters.
            cursor = await conn.execute(
                pgsql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {}({})").format(
                    pgsql.Identifier(name), pgsql.SQL(", ").join(pgsql.Literal(a) for a in arguments)
                )
            )
            return await cursor.fetchone()
    finally:
        # A prepared statement is the session's, not the transaction's (PostgreSQL drops it with
        # the rollback only in some cases): gone either way, and the real error, if any, kept.
        if await _is_prepared(conn, name):
            await conn.execute(f"DEALLOCATE {name}")


async def _is_prepared(conn: psycopg.AsyncConnection[Any], name: str) -> bool:
    cursor = await conn.execute("SELECT 1 FROM pg_prepared_statements WHERE name = %s", (name,))
    return await cursor.fetchone() is not None


async def prepared_statements(db: Database) -> list[str]:
    """The statements prepared on the pool's connection (give it one: ``max_size=1``)."""
    rows = await db.fetchall("SELECT statement FROM pg_prepared_statements", what="prepared", prepare=False)
    return [r["statement"] for r in rows]


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of a plan, depth first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)
