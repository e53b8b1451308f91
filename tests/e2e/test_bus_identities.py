"""The bus is a trust boundary: every identity can do exactly its role on NATS.

A permission matrix (each service, the operator, a connector, no credentials, against every class
of subject) checked against a real NATS server configured by the session, with the pairing service
admitting the connector; then a connector's whole life: it talks to its agent through its own
durable consumer, cannot reach another source, agent or RPC, and is cut off within seconds of its
revocation.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
import pytest
from google.protobuf.message import DecodeError
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.js.api import AckPolicy, ConsumerConfig

from parley.v1 import pairing_pb2, runtime_pb2
from parley.v1.pairing_nats import PairingClient
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import DEFAULT_AGENT_ID, SessionEnv, Suite, inbound

SOURCE = "telegram"
OTHER_AGENT = str(uuid.uuid4())


@dataclass
class Probe:
    """A NATS connection that records which of its publishes and subscriptions the server refused."""

    nc: Client | None
    refusals: list[str] = field(default_factory=list)

    async def publish(self, subject: str) -> bool:
        if self.nc is None:
            return False
        self.refusals.clear()
        await self.nc.publish(subject, b"probe")
        await self.nc.flush()
        await asyncio.sleep(0.05)  # the -ERR precedes the PONG; its callback runs right after
        return not any(f'publish to "{subject.lower()}"' in r for r in self.refusals)

    async def subscribe(self, subject: str) -> bool:
        if self.nc is None:
            return False
        self.refusals.clear()
        sub = await self.nc.subscribe(subject)
        await self.nc.flush()
        await asyncio.sleep(0.05)
        refused = any(f'subscription to "{subject.lower()}"' in r for r in self.refusals)
        if not refused:
            await sub.unsubscribe()
        return not refused

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()


async def connect(
    url: str, *, user: str | None = None, password: str | None = None, inbox: str = ""
) -> Probe:
    probe = Probe(None)

    async def on_error(exc: Exception) -> None:
        probe.refusals.append(str(exc).lower())

    options: dict[str, object] = {"error_cb": on_error, "allow_reconnect": False, "connect_timeout": 3}
    if user is not None:
        options.update(user=user, password=password or "")
    if inbox:
        options["inbox_prefix"] = inbox
    nc = Client()
    try:
        await nc.connect(url, **options)  # type: ignore[arg-type]
    except (nats.errors.Error, OSError, TimeoutError):
        await nc.close()  # a refused connection leaves its socket open otherwise
        return probe
    probe.nc = nc
    return probe


@dataclass
class Bus:
    suite: Suite
    env: SessionEnv
    ns: str
    pairing: PairingClient

    async def add_connector(self, name: str, *, source: str = SOURCE) -> pairing_pb2.AddConnectorResponse:
        return await self.pairing.AddConnector(
            pairing_pb2.AddConnectorRequest(name=name, agent_id=DEFAULT_AGENT_ID, source=source)
        )

    async def as_connector(self, name: str, password: str) -> Probe:
        return await connect(
            self.env.endpoints.nats_url, user=name, password=password, inbox=f"_INBOX.connector.{name}"
        )


@pytest.fixture(scope="module")
async def bus(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bus]:
    ns = f"i{secrets.token_hex(4)}"
    suite = Suite(test_env, tmp_path_factory.mktemp("identities"), ns)
    try:
        await suite.start(runtimes=1)
        await suite.add_service("parley_pairing", "PAIRING")
        operator = await suite.connect()
        try:
            yield Bus(suite, test_env, ns, PairingClient(RpcClient(operator), timeout=10))
        finally:
            await operator.close()
    finally:
        suite.stop()


# What each identity may publish and subscribe to, written from the design (DESIGN.md, "The edge")
# and not from the code that configures it. {ns} is the namespace, {a} the connector's agent,
# {b} another agent, {s} its source.
PUBLISH = {
    "{ns}.authz.Decide": {"runtime", "operator"},
    "{ns}.authz.ListStuckToolCalls": {"operator"},
    "{ns}.authz.Settle": {"runtime", "operator"},
    "{ns}.runtime.UpsertAgent": {"operator"},
    "{ns}.runtime.ListMemories": {"operator", "web"},
    "{ns}.runtime.ListAgents": {"operator", "web"},
    "{ns}.runtime.SetParticipantRole": {"operator"},
    "{ns}.runtime.SetMute": {"operator"},
    "{ns}.runtime.ListParticipants": {"operator"},
    "{ns}.authz.Authorize": {"runtime", "operator"},
    "{ns}.authz.RegisterDecision": {"runtime", "operator"},
    "{ns}.authz.PutAccountSnapshot": {"operator"},
    "{ns}.authz.RevokeAccountSnapshot": {"operator"},
    "{ns}.runtime.AddCustomAction": {"operator"},
    "{ns}.runtime.AddDocument": {"operator"},
    "{ns}.runtime.ListDeadLetters": {"operator"},
    "{ns}.runtime.ReplayDeadLetters": {"operator"},
    "{ns}.runtime.PurgeDeadLetters": {"operator"},
    "{ns}.pairing.IsAllowed": {"runtime", "operator"},
    "{ns}.pairing.ApproveCode": {"operator"},
    "{ns}.pairing.AddConnector": {"operator"},
    "{ns}.pairing.RevokeConnector": {"operator"},
    "{ns}.pairing.ConnectorByApiKey": {"operator", "web"},
    "{ns}.model.Generate": {"runtime", "operator"},
    "{ns}.model.GenerateStream": {"runtime", "operator"},
    "{ns}.model.stream.x": {"runtime", "operator"},
    "_INBOX.runtime.stream.x": {"model", "operator"},
    "_INBOX.runtime.x": {"operator"},
    "_INBOX.scheduler.x": {"operator"},
    "{ns}.runtime.CancelTurn": {"operator"},
    "{ns}.runtime.turns.cancel": {"runtime", "operator"},
    "{ns}.stream.{a}.{s}": {"runtime", "operator"},
    "{ns}.cancel.{a}.{s}": {"operator", "connector"},
    "{ns}.cancel.{a}.other": {"operator"},
    "{ns}.cancel.{b}.{s}": {"operator"},
    "{ns}.model.SetBudget": {"operator"},
    "{ns}.scheduler.CreateTask": {"runtime", "model", "operator"},
    "{ns}.scheduler.DeleteTask": {"operator"},
    "{ns}.tasks.run.RUNTIME_EMBED_BACKFILL": {"scheduler", "operator"},
    "{ns}.inbound.{a}.{s}": {"runtime", "operator", "connector"},
    "{ns}.inbound.{a}.other": {"runtime", "operator"},
    "{ns}.inbound.{a}.web": {"runtime", "operator", "web"},
    "{ns}.inbound.{b}.web": {"runtime", "operator", "web"},
    "{ns}.cancel.{a}.web": {"operator", "web"},
    "{ns}.inbound.{b}.{s}": {"runtime", "operator"},
    "{ns}.self.{a}": {"runtime", "operator"},
    "{ns}.outbound.{a}.{s}": {"runtime", "operator"},
    "{ns}.outbound.{a}.web": {"runtime", "operator"},
    "{ns}.events.{a}.RUN_STARTED": {"runtime", "authz", "operator"},
    "{ns}.dead.PARLEY_INBOUND": {"runtime", "authz", "operator"},
    "$JS.API.STREAM.NAMES": {"runtime", "authz", "operator"},
    "$JS.API.STREAM.DELETE.{NS}_INBOUND": {"runtime", "authz", "operator"},
    "$JS.API.CONSUMER.MSG.NEXT.{NS}_INBOUND.runtime": {"runtime", "authz", "operator"},
    # The web service's own durable consumer, only with the filter of the web source's replies.
    "$JS.API.CONSUMER.CREATE.{NS}_OUTBOUND.web.{ns}.outbound.*.web": {"runtime", "authz", "operator", "web"},
    "$JS.API.CONSUMER.CREATE.{NS}_OUTBOUND.web.{ns}.outbound.*.{s}": {"runtime", "authz", "operator"},
    "$JS.API.CONSUMER.CREATE.{NS}_OUTBOUND.web.{ns}.outbound.>": {"runtime", "authz", "operator"},
    "$JS.API.CONSUMER.DURABLE.CREATE.{NS}_OUTBOUND.web": {"runtime", "authz", "operator"},
    "$JS.API.CONSUMER.MSG.NEXT.{NS}_OUTBOUND.web": {"runtime", "authz", "operator", "web"},
    "$JS.API.CONSUMER.MSG.NEXT.{NS}_OUTBOUND.runtime": {"runtime", "authz", "operator"},
}
SUBSCRIBE = {
    "{ns}.authz.Decide": {"authz", "operator"},
    "{ns}.runtime.GetTurn": {"runtime", "operator"},
    "{ns}.pairing.AddConnector": {"pairing", "operator"},
    "{ns}.outbound.{a}.{s}": {"operator"},
    "{ns}.outbound.{a}.api": {"runtime", "operator"},
    "{ns}.outbound.{a}.web": {"operator"},
    "{ns}.stream.{a}.{s}": {"operator", "connector"},
    "{ns}.stream.{b}.{s}": {"operator"},
    "{ns}.stream.{a}.web": {"operator", "web"},
    "{ns}.stream.{b}.web": {"operator", "web"},
    "{ns}.stream.{a}.other": {"operator"},
    "{ns}.cancel.{a}.{s}": {"runtime", "operator"},
    "{ns}.model.stream.x": {"model", "operator"},
    "{ns}.cancel.{a}.web": {"runtime", "operator"},
    "{ns}.events.{a}.RUN_STARTED": {"operator"},
    "{ns}.inbound.{a}.{s}": {"operator"},
    "{ns}.dead.PARLEY_INBOUND": {"operator"},
    "$SYS.REQ.USER.AUTH": {"pairing", "operator"},
    "_INBOX.runtime.x": {"runtime", "operator"},
    "_INBOX.connector.other.x": {"operator"},
    "_INBOX.>": {"operator"},
}
IDENTITIES = (
    "runtime",
    "model",
    "scheduler",
    "authz",
    "pairing",
    "web",
    "operator",
    "connector",
    "anonymous",
)


def _subject(template: str, ns: str) -> str:
    return template.format(ns=ns, NS=ns.upper(), a=DEFAULT_AGENT_ID, b=OTHER_AGENT, s=SOURCE)


async def test_every_identity_can_do_exactly_its_role(bus: Bus) -> None:
    created = await bus.add_connector(f"matrix-{secrets.token_hex(3)}")
    probes = {
        name: await connect(bus.env.url_for(name))
        for name in IDENTITIES
        if name not in ("connector", "anonymous")
    }
    probes["connector"] = await bus.as_connector(created.connector.name, created.password)
    probes["anonymous"] = await connect(bus.env.endpoints.nats_url)
    assert probes["anonymous"].nc is None, "an anonymous connection was accepted"
    assert all(probes[name].nc is not None for name in IDENTITIES if name != "anonymous")
    wrong: list[str] = []
    checked = 0
    try:
        for kind, table in (("publish", PUBLISH), ("subscribe", SUBSCRIBE)):
            for template, allowed in table.items():
                subject = _subject(template, bus.ns)
                for name in IDENTITIES:
                    probe = probes[name]
                    granted = await (
                        probe.publish(subject) if kind == "publish" else probe.subscribe(subject)
                    )
                    checked += 1
                    if granted != (name in allowed):
                        wrong.append(f"{name} {kind} {subject}: {'allowed' if granted else 'refused'}")
    finally:
        for probe in probes.values():
            await probe.close()
    assert checked == len(IDENTITIES) * (len(PUBLISH) + len(SUBSCRIBE))
    assert wrong == []


async def test_only_the_worker_hosts_may_answer_a_request_more_than_once(bus: Bus) -> None:
    """The scheduler sends up to 64 runs in one request and a worker host answers each run on its
    reply subject as it ends; every other service answers a request once."""
    operator = await connect(bus.env.url_for("operator"))
    assert operator.nc is not None
    # Each answers on a subject of its own that no running service serves (so every answer counted
    # is the probe's).
    serving = {name: f"{bus.ns}.{name}.ProbeAnswers" for name in ("runtime", "model", "authz", "scheduler")}
    answered: dict[str, int] = {}
    try:
        for name, subject in serving.items():
            probe = await connect(bus.env.url_for(name))
            assert probe.nc is not None
            try:

                async def answer_three_times(msg: Any, nc: Client = probe.nc) -> None:
                    for i in range(3):
                        await nc.publish(msg.reply, f"answer {i}".encode())

                await probe.nc.subscribe(subject, queue="probe", cb=answer_three_times)
                await probe.nc.flush()
                inbox = f"_INBOX.operator.{secrets.token_hex(6)}"
                replies = await operator.nc.subscribe(inbox)
                # Until the server routes the request to the probe: its answer to a request that
                # found no subscriber yet is a "no responders" status, not an answer of the probe's.
                for _ in range(50):
                    await operator.nc.publish(subject, b"request", reply=inbox)
                    first = await replies.next_msg(timeout=5.0)
                    if (first.headers or {}).get("Status") != NO_RESPONDERS_STATUS:
                        break
                    await asyncio.sleep(0.1)
                got = [first.data]
                with contextlib.suppress(TimeoutError):
                    while True:  # until none has come for a second
                        got.append((await replies.next_msg(timeout=1.0)).data)
                assert got == [f"answer {i}".encode() for i in range(len(got))]
                answered[name] = len(got)
                await replies.unsubscribe()
            finally:
                await probe.close()
    finally:
        await operator.close()
    assert answered == {"runtime": 3, "model": 3, "authz": 1, "scheduler": 1}


async def test_a_wrong_password_is_refused_for_services_and_connectors(bus: Bus) -> None:
    created = await bus.add_connector(f"wrongpw-{secrets.token_hex(3)}")
    refused_service = await connect(bus.env.endpoints.nats_url, user="runtime", password="not-it")
    refused_connector = await bus.as_connector(created.connector.name, "not-it")
    unknown = await bus.as_connector("nobody-here", created.password)
    assert (refused_service.nc, refused_connector.nc, unknown.nc) == (None, None, None)


async def test_a_connector_talks_to_its_agent_through_its_own_consumer(bus: Bus) -> None:
    created = await bus.add_connector(f"chat-{secrets.token_hex(3)}")
    name = created.connector.name
    probe = await bus.as_connector(name, created.password)
    assert probe.nc is not None
    js = probe.nc.jetstream()
    stream, durable = f"{bus.ns.upper()}_OUTBOUND", f"connector-{name}"
    try:
        await js.add_consumer(
            stream,
            ConsumerConfig(
                name=durable,
                durable_name=durable,
                filter_subject=f"{bus.ns}.outbound.{DEFAULT_AGENT_ID}.{SOURCE}",
                ack_policy=AckPolicy.EXPLICIT,
            ),
        )
        message = inbound("hello from a connector", source=SOURCE)
        await js.publish(
            f"{bus.ns}.inbound.{DEFAULT_AGENT_ID}.{SOURCE}",
            message.SerializeToString(),
            headers={"Nats-Msg-Id": f"{SOURCE}:{message.message_id}"},
        )
        sub = await js.pull_subscribe_bind(durable, stream)

        async def reply() -> runtime_pb2.OutboundMessage | None:
            """The reply to our message; anything else on the subject (the matrix's probes) is skipped."""
            try:
                [msg] = await sub.fetch(1, timeout=1)
            except nats.errors.TimeoutError:
                return None
            await msg.ack()
            try:
                found = runtime_pb2.OutboundMessage.FromString(msg.data)
            except DecodeError:
                return None
            return found if found.in_reply_to == message.message_id else None

        answer = await eventually(reply, timeout=30, what="the reply through the connector's consumer")
        assert answer.text == "You said: hello from a connector"
        assert answer.in_reply_to == message.message_id

        # Another source's replies: the consumer it would need cannot be created.
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await js.add_consumer(
                stream,
                ConsumerConfig(
                    name=durable,
                    durable_name=durable,
                    filter_subject=f"{bus.ns}.outbound.{DEFAULT_AGENT_ID}.other",
                    ack_policy=AckPolicy.EXPLICIT,
                ),
                timeout=2,
            )
        # No RPC at all: a request to authz is refused by the server, and nothing answers.
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await probe.nc.request(f"{bus.ns}.authz.Decide", b"", timeout=1)
        assert any(f'publish to "{bus.ns}.authz.decide"' in r for r in probe.refusals)
    finally:
        await probe.close()


async def test_a_revoked_connector_is_cut_off_within_seconds(bus: Bus) -> None:
    created = await bus.add_connector(f"revoked-{secrets.token_hex(3)}")
    name = created.connector.name
    closed = asyncio.Event()
    refusals: list[str] = []

    async def on_closed() -> None:
        closed.set()

    async def on_error(exc: Exception) -> None:
        refusals.append(str(exc))

    nc = await nats.connect(
        bus.env.endpoints.nats_url,
        user=name,
        password=created.password,
        inbox_prefix=f"_INBOX.connector.{name}",
        closed_cb=on_closed,
        error_cb=on_error,
        # Kicked, a client would reconnect and be refused by the callout; a fresh connection
        # below shows the refusal without nats-py's reconnect loop leaking its refused sockets.
        allow_reconnect=False,
    )
    try:
        subject = f"{bus.ns}.inbound.{DEFAULT_AGENT_ID}.{SOURCE}"
        await nc.publish(subject, b"before")
        await nc.flush()
        revoked = await bus.pairing.RevokeConnector(pairing_pb2.RevokeConnectorRequest(name=name))
        assert revoked.connections_closed == 1
        assert revoked.connector.HasField("revoked_at")
        await asyncio.wait_for(closed.wait(), timeout=10)
        assert nc.is_closed
        again = await bus.as_connector(name, created.password)
        assert again.nc is None
    finally:
        if not nc.is_closed:
            await nc.close()
    listed = await bus.pairing.ListConnectors(pairing_pb2.ListConnectorsRequest(include_revoked=False))
    assert name not in {c.name for c in listed.connectors}
