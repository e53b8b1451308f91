"""The Telegram and Slack connectors as real processes against the suite and the fake platforms.

A module's suite (gateway, runtime, pairing) runs in a namespace of its own; each connector is
created through pairing's AddConnector and given the credentials file `parley connectors add`
writes (its own code), then started as ``python -m parley_telegram`` / ``parley_slack``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from parley.v1 import pairing_pb2, runtime_pb2
from parley.v1.pairing_nats import PairingClient
from parley_cli.connectors_commands import credentials
from parley_devinfra.fake_slack import FakeSlack
from parley_devinfra.fake_telegram import FakeTelegram
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess, eventually
from support import DEFAULT_AGENT_ID, SessionEnv, Suite

TELEGRAM_TOKEN = f"7000001:{secrets.token_urlsafe(24)}"
SLACK_TOKEN = f"xoxb-{secrets.token_hex(12)}"
SLACK_SECRET = secrets.token_hex(16)
# The scripted model streams this answer word by word (tests/e2e/rules.yaml).
STREAM_ASK = "please stream a short answer"
STREAMED = "Streaming reaches Telegram and Slack by editing one message as the words arrive."


@dataclass
class Chat:
    suite: Suite
    operator: Bus
    pairing: PairingClient
    root: Path
    telegram: FakeTelegram
    slack: FakeSlack
    processes: list[ServiceProcess] = field(default_factory=list)

    async def credentials_file(self, source: str, agent_id: str = DEFAULT_AGENT_ID) -> Path:
        created = await self.pairing.AddConnector(
            pairing_pb2.AddConnectorRequest(
                name=f"{source}-{secrets.token_hex(4)}", agent_id=agent_id, source=source
            )
        )
        path = self.root / f"{created.connector.name}.json"
        path.write_text(json.dumps(credentials(created, self.suite.env.endpoints.nats_url)))
        return path

    def _process(self, module: str, creds: Path, **env: str) -> ServiceProcess:
        name = creds.stem
        process = ServiceProcess(
            module,
            {
                "PARLEY_CONNECTOR_CREDENTIALS": str(creds),
                "PARLEY_CONNECTOR_STATE": str(self.root / f"{name}.sqlite"),
                "PARLEY_CONNECTOR_EDIT_INTERVAL": "0.2",
                **env,
            },
            self.root / f"{name}.log",
            0,
        )
        self.processes.append(process)
        return process

    def telegram_process(self, creds: Path, fake: FakeTelegram | None = None, **env: str) -> ServiceProcess:
        """A Telegram connector process, polling ``fake`` (the module's, unless a test has its own:
        Telegram lets one poller per bot take the updates)."""
        defaults = {
            "PARLEY_TELEGRAM_TOKEN": TELEGRAM_TOKEN,
            "PARLEY_TELEGRAM_API_URL": (fake or self.telegram).base_url,
            "PARLEY_TELEGRAM_POLL_SECONDS": "1",
        }
        return self._process("parley_telegram", creds, **{**defaults, **env})

    def slack_process(self, creds: Path, port: int, **env: str) -> ServiceProcess:
        defaults = {
            "PARLEY_SLACK_BOT_TOKEN": SLACK_TOKEN,
            "PARLEY_SLACK_SIGNING_SECRET": SLACK_SECRET,
            "PARLEY_SLACK_API_URL": self.slack.base_url,
            "PARLEY_SLACK_PORT": str(port),
        }
        return self._process("parley_slack", creds, **{**defaults, **env})

    async def start_telegram(
        self, creds: Path | None = None, fake: FakeTelegram | None = None
    ) -> ServiceProcess:
        """A Telegram connector, polling the fake (``getUpdates`` seen)."""
        fake = fake or self.telegram
        process = self.telegram_process(creds or await self.credentials_file("telegram"), fake)
        polls = fake.calls.count("getUpdates")
        process.start()
        await wait_alive(process, lambda: fake.calls.count("getUpdates") > polls, "polling")
        return process

    async def start_slack(self, creds: Path | None = None, port: int = 0) -> tuple[ServiceProcess, str]:
        """A Slack connector and its Events API URL, once it listens."""
        port = port or free_port()
        process = self.slack_process(creds or await self.credentials_file("slack"), port).start()

        def listening() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        await wait_alive(process, listening, "listening")
        return process, f"http://127.0.0.1:{port}/slack/events"

    def stop_all(self) -> None:
        for process in self.processes:
            process.stop()


@contextlib.asynccontextmanager
async def running_chat(test_env: SessionEnv, root: Path) -> AsyncIterator[Chat]:
    """The suite (gateway, runtime, pairing) in a namespace of its own, and the fake platforms."""
    suite = Suite(test_env, root, f"c{secrets.token_hex(4)}")
    telegram = await FakeTelegram(TELEGRAM_TOKEN).start()
    slack = await FakeSlack(SLACK_TOKEN, SLACK_SECRET).start()
    found: Chat | None = None
    try:
        await suite.start(runtimes=1)
        await suite.add_service("parley_pairing", "PAIRING")
        operator = await suite.connect()
        found = Chat(suite, operator, PairingClient(RpcClient(operator), timeout=10), root, telegram, slack)
        try:
            yield found
        finally:
            await operator.close()
    finally:
        if found is not None:
            found.stop_all()
        suite.stop()
        await telegram.stop()
        await slack.stop()


async def wait_alive(
    process: ServiceProcess, ready: Callable[[], bool], what: str, *, timeout: float = 30
) -> None:
    """Until ``ready()``; the process exiting first fails with its log."""

    async def check() -> bool:
        if process.process is not None and process.process.poll() is not None:
            raise AssertionError(
                f"{process.module} exited with {process.process.returncode}:\n{process.log()}"
            )
        return ready()

    await eventually(check, timeout=timeout, interval=0.05, what=f"{process.module} {what}")


async def settle(seconds: float = 1.5) -> None:
    """Time for a wrong second answer to show up, were there one."""
    await asyncio.sleep(seconds)


async def publish_stream(
    bus: Bus,
    source: str,
    channel_id: str,
    in_reply_to: str,
    deltas: list[tuple[int, str]],
    *,
    outcome: str = "",
) -> str:
    """Stream chunks as the runtime publishes them (``(sequence, delta)``); returns the response id.
    A final chunk is added when ``outcome`` is given."""
    response_id = str(uuid.uuid4())
    subject = f"{bus.subjects.ns}.stream.{DEFAULT_AGENT_ID}.{source}"
    for sequence, delta in deltas:
        chunk = runtime_pb2.StreamChunk(
            agent_id=DEFAULT_AGENT_ID,
            source=source,
            turn_id="t-" + response_id,
            response_id=response_id,
            channel_id=channel_id,
            in_reply_to=in_reply_to,
            sequence=sequence,
            delta=delta,
        )
        await bus.nc.publish(subject, chunk.SerializeToString())
        await asyncio.sleep(0.05)
    if outcome:
        final = runtime_pb2.StreamChunk(
            agent_id=DEFAULT_AGENT_ID,
            source=source,
            response_id=response_id,
            channel_id=channel_id,
            sequence=(deltas[-1][0] + 1) if deltas else 1,
            final=True,
            outcome=outcome,
        )
        await bus.nc.publish(subject, final.SerializeToString())
    await bus.nc.flush()
    return response_id


async def publish_reply(
    bus: Bus, source: str, response_id: str, channel_id: str, in_reply_to: str, text: str
) -> None:
    """The durable reply, as the runtime publishes it (Nats-Msg-Id = response_id)."""
    reply = runtime_pb2.OutboundMessage(
        agent_id=DEFAULT_AGENT_ID,
        source=source,
        response_id=response_id,
        channel_id=channel_id,
        in_reply_to=in_reply_to,
        text=text,
    )
    await bus.publish(
        bus.subjects.outbound(DEFAULT_AGENT_ID, source), reply.SerializeToString(), msg_id=response_id
    )
