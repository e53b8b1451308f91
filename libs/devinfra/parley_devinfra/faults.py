"""Fault injection: the suite as real processes on a NATS and a PostgreSQL of its own, a steady
load of DMs (each in its own room), faults caused while the load runs, replies counted from the
OUTBOUND stream.

``Rig`` starts an embedded NATS (with the deployment's identities) and an embedded PostgreSQL,
a ``TcpProxy`` in front of each (the services connect through them), and the model gateway,
pairing, authz and the runtime. The agent ``faults`` has DM policy ``allowlist`` and the load's
sender is allowlisted, so every turn asks pairing and the model gateway, and writes PostgreSQL.

``run_scenario`` publishes at a steady rate before, during and after a fault, then waits for the
backlog to drain, and reports: messages published (acked by JetStream), answered once,
duplicated, dead-lettered, unanswered, and the drain time: from recovery until every message
published up to recovery has its reply.
``tests/e2e/test_faults.py`` runs every scenario briefly; ``bench/faults.py`` at full length.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import nats.errors
import nats.js.errors
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nats.js.api import ConsumerConfig, DeliverPolicy

from parley.v1 import pairing_pb2, runtime_pb2
from parley.v1.pairing_nats import PairingClient
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess

from .infra import AUTH_DIR, EmbeddedNats, EmbeddedPostgres, free_port, postgres_bin_dir
from .natsauth import CONFIG_FILE, NatsAuth
from .proxy import TcpProxy

AGENT_NAMESPACE = uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579")
AGENT = "faults"
AGENT_ID = str(uuid.uuid5(AGENT_NAMESPACE, f"agent:{AGENT}"))
SOURCE = "discord"  # a connector's DM: the pairing gate is asked
SENDER = "loadgen"
DEFAULT_CHARACTER = Path(__file__).resolve().parents[3] / "characters" / "default.yaml"
SERVICES = {  # module -> the settings prefix of its ports
    "parley_gateway": "GATEWAY",
    "parley_pairing": "PAIRING",
    "parley_authz": "AUTHZ",
    "parley_runtime": "RUNTIME",
}


@dataclass
class Result:
    fault: str
    published: int
    answered_once: int
    duplicated: int
    dead_lettered: int
    unanswered: int
    outage_seconds: float
    drain_seconds: float
    failed_publishes: int = 0  # refused while NATS itself was down: never acked, not counted

    def row(self) -> str:
        return (
            f"| {self.fault} | {self.published} | {self.answered_once} | {self.duplicated} | "
            f"{self.dead_lettered} | {self.unanswered} | {self.outage_seconds:.0f} s "
            f"| {self.drain_seconds:.1f} s |"
        )


HEADER = (
    "| fault during the load | published | answered once | duplicated | dead-lettered | unanswered "
    "| outage | drain after recovery |\n|---|---|---|---|---|---|---|---|"
)


@dataclass
class Rig:
    root: Path
    settings: dict[str, str] = field(default_factory=dict)  # extra settings for every service
    processes: dict[str, ServiceProcess] = field(default_factory=dict)

    async def start(self) -> Rig:
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> Rig:
        self.namespace = f"f{secrets.token_hex(4)}"
        auth_dir = self.root / AUTH_DIR
        auth_dir.mkdir(parents=True, exist_ok=True)
        self.auth = NatsAuth.ensure(auth_dir)
        self.nats = EmbeddedNats(
            self.root / "nats", log_file=self.root / "logs" / "nats.log", config_file=auth_dir / CONFIG_FILE
        )
        self.nats.start()
        # PostgreSQL refuses to run as root: its folder must be reachable by user postgres (not
        # under a 0700 TMPDIR of a test's).
        self.pg_root = Path(
            tempfile.mkdtemp(prefix="parley-faults-pg-", dir="/tmp" if os.geteuid() == 0 else None)
        )
        self.pg_root.chmod(0o711)
        self.pg = EmbeddedPostgres(self.pg_root / "data", log_file=self.pg_root / "postgres.log")
        self.pg.start()
        self.nats_proxy = TcpProxy(self.nats.port)
        self.pg_proxy = TcpProxy(self.pg.port)
        await self.nats_proxy.start()
        await self.pg_proxy.start()
        characters = self.root / "characters"
        characters.mkdir(exist_ok=True)
        character = yaml.safe_load(DEFAULT_CHARACTER.read_text())
        character.update(name=AGENT, settings={"DM_POLICY": "allowlist"})
        (characters / f"{AGENT}.yaml").write_text(yaml.safe_dump(character))
        self.env = {
            **self.auth.services_env(),
            "PARLEY_NATS_URL": f"nats://127.0.0.1:{self.nats_proxy.port}",
            "PARLEY_DATABASE_URL": self.pg.url.replace(f":{self.pg.port}/", f":{self.pg_proxy.port}/"),
            "PARLEY_NAMESPACE": self.namespace,
            "PARLEY_OPERATOR_TOKEN": secrets.token_hex(16),
            "PARLEY_CHARACTERS_DIR": str(characters),
            "PARLEY_ENVIRONMENT": "test",
            "PARLEY_MODEL_PROVIDER": "scripted",
            **self.settings,
        }
        for module in SERVICES:
            await self.start_service(module)
        self.bus = await self.connect()
        pairing = PairingClient(RpcClient(self.bus), timeout=10)
        await pairing.AddToAllowlist(
            pairing_pb2.AddToAllowlistRequest(agent_id=AGENT_ID, channel=SOURCE, sender_id=SENDER)
        )
        return self

    async def connect(self) -> Bus:
        """The operator, straight to NATS (not through the proxy): the load and the counting."""
        return await Bus.connect(
            self.auth.url(self.nats.url, "operator"), name="faults", namespace=self.namespace
        )

    async def start_service(self, module: str) -> ServiceProcess:
        previous = self.processes.get(module)
        if previous is not None:
            env, port = previous.env, previous.grpc_port
        else:
            key, port = SERVICES[module], free_port()
            env = {
                **self.env,
                f"PARLEY_{key}_GRPC_PORT": str(port),
                f"PARLEY_{key}_METRICS_PORT": str(free_port()),
            }
        process = ServiceProcess(module, env, self.root / "logs" / f"{module}.log", port).start()
        self.processes[module] = process
        await process.wait_ready(timeout=60)
        return process

    def stop_postgres(self, mode: str = "immediate") -> None:
        pg_ctl = str(postgres_bin_dir() / "pg_ctl")
        self.pg._run([pg_ctl, "-D", str(self.pg.data_dir), "-m", mode, "-w", "stop"], "pg_ctl stop", 60)

    async def stop(self) -> None:
        """Stop whatever was started (also after a start that failed half-way)."""
        for process in reversed(list(self.processes.values())):
            process.stop()
        if getattr(self, "bus", None) is not None:
            await self.bus.close()
        for proxy in ("nats_proxy", "pg_proxy"):
            if hasattr(self, proxy):
                await getattr(self, proxy).stop()
        if hasattr(self, "nats"):
            self.nats.stop()
        if hasattr(self, "pg"):
            self.pg.stop()
        if hasattr(self, "pg_root"):
            shutil.rmtree(self.pg_root, ignore_errors=True)


class Load:
    """DMs published at a steady rate, each in its own room, and their replies read back."""

    def __init__(self, bus: Bus, rate: float, tag: str) -> None:
        self.bus = bus
        self.rate = rate
        self.tag = tag
        self.published: dict[str, float] = {}
        self.failed = 0
        self.first_reply: dict[str, float] = {}
        self.replies: Counter[str] = Counter()
        self._read_to = 0
        self._stopped = asyncio.Event()

    async def publish(self, seconds: float) -> None:
        started = time.monotonic()
        n = 0
        while (due := started + n / self.rate) < started + seconds:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            n += 1
            message_id = f"{self.tag}-{n}"
            message = runtime_pb2.InboundMessage(
                agent_id=AGENT_ID,
                source=SOURCE,
                message_id=message_id,
                sender_id=SENDER,
                sender_name="Load",
                channel_id=f"dm-{message_id}",
                room_type=runtime_pb2.ROOM_TYPE_DM,
                text=f"hello {n}",
            )
            try:
                await self.bus.publish(
                    self.bus.subjects.inbound(AGENT_ID, SOURCE),
                    message.SerializeToString(),
                    msg_id=f"{SOURCE}:{message_id}",
                    timeout=2,
                )
                self.published[message_id] = time.monotonic()
            except ParleyError:
                self.failed += 1

    async def read_replies(self) -> None:
        """Read the OUTBOUND stream from where the last read stopped."""
        stream = self.bus.subjects.stream("OUTBOUND")
        subject = self.bus.subjects.outbound(AGENT_ID, SOURCE)
        try:
            last = (await self.bus.js.get_last_msg(stream, subject)).seq or 0
        except nats.js.errors.NotFoundError:
            return
        if last <= self._read_to:
            return
        sub = await self.bus.js.subscribe(
            subject,
            ordered_consumer=True,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._read_to + 1
            ),
        )
        try:
            while self._read_to < last:
                msg = await sub.next_msg(timeout=5)
                self._read_to = msg.metadata.sequence.stream
                reply = runtime_pb2.OutboundMessage.FromString(msg.data)
                if reply.in_reply_to.startswith(f"{self.tag}-"):
                    self.replies[reply.in_reply_to] += 1
                    self.first_reply.setdefault(reply.in_reply_to, time.monotonic())
        finally:
            await sub.unsubscribe()

    async def follow(self, interval: float = 0.25) -> None:
        """Read replies as they come (a read that fails while NATS is away is tried again), until
        ``stop_following``. Not by cancelling alone: nats-py's ``_flush_pending``, under every
        write, swallows a cancellation that lands in it, and a full ``bench/faults.py`` run once
        waited forever for this loop after its scenario had every reply."""
        while not self._stopped.is_set():
            with contextlib.suppress(ParleyError, TimeoutError, nats.errors.Error):
                await self.read_replies()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), interval)

    def stop_following(self) -> None:
        self._stopped.set()

    def unanswered(self) -> int:
        return sum(1 for m in self.published if self.replies[m] == 0)

    async def dead_lettered(self) -> int:
        subject = self.bus.subjects.dead(self.bus.subjects.stream("INBOUND"))
        stream = self.bus.subjects.stream("DEAD")
        info = await self.bus.js.stream_info(stream, subjects_filter=subject)
        if not (info.state.subjects or {}).get(subject):
            return 0
        sub = await self.bus.js.subscribe(
            subject, ordered_consumer=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        )
        found = 0
        try:
            for _ in range(int((info.state.subjects or {})[subject])):
                msg = await sub.next_msg(timeout=5)
                if runtime_pb2.InboundMessage.FromString(msg.data).message_id in self.published:
                    found += 1
        finally:
            await sub.unsubscribe()
        return found


Step = Callable[[], Awaitable[object]]


async def run_scenario(
    rig: Rig,
    fault: str,
    cause: Step,
    recover: Step,
    *,
    outage: float,
    rate: float,
    before: float = 3.0,
    after: float = 3.0,
    drain_timeout: float = 120.0,
    during: Step | None = None,
) -> Result:
    """Load for ``before`` s, ``cause``, ``outage`` s of load (then ``during``), ``recover``,
    ``after`` s of load, then wait (up to ``drain_timeout``) until every published message is answered."""
    load = Load(rig.bus, rate, f"{fault}-{secrets.token_hex(3)}")
    publishing = asyncio.create_task(load.publish(before + outage + after))
    reading = asyncio.create_task(load.follow())  # replies timed as they come, not at the end
    await asyncio.sleep(before)
    down_at = time.monotonic()
    await cause()
    await asyncio.sleep(max(0.0, outage - (time.monotonic() - down_at)))
    if during is not None:
        await during()  # checks made while the fault lasts
    await recover()
    recovered = time.monotonic()
    await publishing
    load.stop_following()
    reading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reading
    deadline = time.monotonic() + drain_timeout
    while True:
        await load.read_replies()
        if load.unanswered() == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # a late duplicate would show up here
    await load.read_replies()
    # The backlog is what was published up to recovery: drained when the last of it is answered.
    backlog = [m for m, at in load.published.items() if at <= recovered]
    last = max((load.first_reply[m] for m in backlog if m in load.first_reply), default=recovered)
    return Result(
        fault=fault,
        published=len(load.published),
        answered_once=sum(1 for m in load.published if load.replies[m] == 1),
        duplicated=sum(1 for m in load.published if load.replies[m] > 1),
        dead_lettered=await load.dead_lettered(),
        unanswered=load.unanswered(),
        outage_seconds=recovered - down_at,
        drain_seconds=max(0.0, last - recovered),
        failed_publishes=load.failed,
    )


def scenarios(rig: Rig, long_outage: float, service_outage: float) -> dict[str, tuple[Step, Step, float]]:
    """Each fault: how to cause it, how to recover, how long it lasts."""

    async def kill_nats() -> None:
        assert rig.nats.pid is not None
        os.kill(rig.nats.pid, 9)

    async def start_nats() -> None:
        await asyncio.to_thread(rig.nats.start)

    async def stop_pg() -> None:
        await asyncio.to_thread(rig.stop_postgres)

    async def start_pg() -> None:
        await asyncio.to_thread(rig.pg.start)

    async def restart_pg() -> None:
        await stop_pg()
        await start_pg()

    async def nothing() -> None:
        return None

    async def kill_gateway() -> None:
        rig.processes["parley_gateway"].kill()

    async def start_gateway() -> None:
        await rig.start_service("parley_gateway")

    async def stop_authz_pairing() -> None:
        rig.processes["parley_authz"].stop()
        rig.processes["parley_pairing"].stop()

    async def start_authz_pairing() -> None:
        await asyncio.gather(rig.start_service("parley_pairing"), rig.start_service("parley_authz"))

    flaky = asyncio.Event()

    async def flap() -> None:
        while not flaky.is_set():
            rig.nats_proxy.drop()
            rig.pg_proxy.drop()
            await asyncio.sleep(2.0)

    flapping: list[asyncio.Task[None]] = []

    async def degrade() -> None:
        rig.nats_proxy.latency = rig.pg_proxy.latency = 0.02
        flaky.clear()
        flapping.append(asyncio.create_task(flap()))

    async def heal() -> None:
        flaky.set()
        await asyncio.gather(*flapping)
        rig.nats_proxy.latency = rig.pg_proxy.latency = 0.0

    return {
        "nats_sigkill": (kill_nats, start_nats, 2.0),
        "postgres_restart_immediate": (restart_pg, nothing, 0.0),
        "postgres_down_long": (stop_pg, start_pg, long_outage),
        "gateway_sigkill": (kill_gateway, start_gateway, service_outage),
        "authz_pairing_stopped": (stop_authz_pairing, start_authz_pairing, service_outage),
        "proxy_latency_and_drops": (degrade, heal, service_outage),
    }


async def health(process: ServiceProcess, service: str = "") -> str:
    """The status on the process's gRPC health endpoint (SERVING, NOT_SERVING): overall (what
    readiness reads), or of one of its services (what liveness reads)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{process.grpc_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def dependency_up(process: ServiceProcess, dependency: str) -> float | None:
    """``parley_dependency_up{dependency}`` on the process's metrics endpoint."""
    key = next(k for k in process.env if k.endswith("_METRICS_PORT") and k.startswith("PARLEY_"))
    with urllib.request.urlopen(f"http://127.0.0.1:{process.env[key]}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf'^parley_dependency_up\{{dependency="{dependency}"\}} ([0-9.e+]+)$', text, re.M)
    return float(found.group(1)) if found else None


def summary(results: list[Result]) -> str:
    return json.dumps({"benchmark": "faults", "results": [asdict(r) for r in results]})
