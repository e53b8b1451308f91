"""The deployed NATS configuration (deploy/nats.conf + the generated deploy/nats-auth.conf) is the one
the code defines, docker-compose hands every node of the cluster every secret and each service only
its own, and three real nats-servers started from those files with a `.env` from
tools/gen_secrets.py form a cluster that keeps three copies of a stream, admits each identity with its
own password on every node, refuses wrong or missing credentials, enforces permissions, and lets
only servers with the route password join."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import nats
import nats.errors
import pytest
import yaml
from nats.aio.client import Client

from parley_devinfra.infra import free_port, nats_server_binary
from parley_platform import permissions
from parley_platform.testing import eventually

ROOT = Path(__file__).resolve().parents[2]
AUTH_CONF = ROOT / "deploy" / "nats-auth.conf"
COMPOSE = ROOT / "docker-compose.yml"
NATS_NODES = ("nats-1", "nats-2", "nats-3")
SERVICE_IDENTITY = {
    "runtime": "runtime",
    "model-gateway": "model",
    "scheduler": "scheduler",
    "authz": "authz",
    "pairing": "pairing",
}


def tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env_refs(text: str) -> set[str]:
    """The variables a NATS config reads (``$NAME`` as a value, not a ``$SYS``/``$JS`` subject)."""
    return set(re.findall(r"(?:password|issuer): \$([A-Z][A-Z0-9_]*)", text))


def test_generated_auth_conf_is_current() -> None:
    assert AUTH_CONF.read_text() == tool("gen_nats_conf").render(), "run `make gen`"
    assert 'include "nats-auth.conf"' in (ROOT / "deploy" / "nats.conf").read_text()


def test_the_auth_conf_holds_no_secret_only_references() -> None:
    refs = env_refs(AUTH_CONF.read_text())
    assert refs == {
        *(f"PARLEY_{name.upper()}_NATS_PASSWORD" for name in permissions.IDENTITIES),
        "PARLEY_NATS_SYSTEM_PASSWORD",
        "PARLEY_NATS_CALLOUT_ISSUER",
    }
    assert not re.search(r"password: \"", AUTH_CONF.read_text()), "a literal password in the deployed config"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_compose_gives_each_nats_node_every_secret_its_config_reads(compose: dict[str, Any]) -> None:
    config = (ROOT / "deploy" / "nats.conf").read_text()
    node_refs = set(re.findall(r"\$(PARLEY_[A-Z0-9_]+)", config))
    assert node_refs == {
        "PARLEY_NATS_SERVER_NAME",
        "PARLEY_NATS_ROUTE_PASSWORD",
        *(f"PARLEY_NATS_ROUTE_{i}" for i in range(1, len(NATS_NODES) + 1)),
    }
    volumes = set()
    for name in NATS_NODES:
        node = compose["services"][name]
        env = node.get("environment") or {}
        for ref in env_refs(AUTH_CONF.read_text()) | {"PARLEY_NATS_ROUTE_PASSWORD"}:
            assert env.get(ref) == f"${{{ref}:?run make secrets}}", f"{name} needs {ref}, required"
        assert node_refs <= env.keys(), f"{name} lacks {node_refs - env.keys()}"
        assert env["PARLEY_NATS_SERVER_NAME"] == name
        routes = [env[f"PARLEY_NATS_ROUTE_{i}"] for i in range(1, len(NATS_NODES) + 1)]
        assert routes == [
            f"nats://route:${{PARLEY_NATS_ROUTE_PASSWORD:?run make secrets}}@{n}:6222" for n in NATS_NODES
        ]
        mounts = {volume.split(":")[1] for volume in node["volumes"] if volume.startswith("./")}
        assert {"/etc/nats/parley.conf", "/etc/nats/nats-auth.conf"} <= mounts, name
        data = [v.split(":")[0] for v in node["volumes"] if v.endswith(":/data")]
        assert len(data) == 1, f"{name} keeps JetStream's store on a volume"
        volumes.add(data[0])
    assert len(volumes) == len(NATS_NODES), "each node needs a store of its own"
    assert "nats" not in compose["services"], "a single NATS server beside the cluster"


def test_compose_gives_each_service_only_its_own_password(compose: dict[str, Any]) -> None:
    shared = compose["x-parley-env"]
    assert not [key for key in shared if "PASSWORD" in key or "CALLOUT" in key], "secrets in the shared env"
    for service, identity in SERVICE_IDENTITY.items():
        env = compose["services"][service]["environment"]
        secrets = {key for key in env if "PASSWORD" in key or "CALLOUT" in key}
        expected = {f"PARLEY_{identity.upper()}_NATS_PASSWORD"}
        if service == "pairing":
            expected |= {"PARLEY_PAIRING_CALLOUT_SEED", "PARLEY_PAIRING_SYSTEM_PASSWORD"}
        assert secrets == expected, service


def test_gen_secrets_writes_every_variable_compose_requires(compose: dict[str, Any]) -> None:
    dotenv = dict(
        line.split("=", 1)
        for line in tool("gen_secrets").render().splitlines()
        if line and not line.startswith("#")
    )
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", COMPOSE.read_text()))
    assert required <= dotenv.keys(), required - dotenv.keys()
    assert all(len(value) >= 24 for value in dotenv.values())
    # The issuer the server trusts is the public key of the seed pairing signs with.
    from parley_devinfra.natsauth import public_key

    assert public_key(dotenv["PARLEY_PAIRING_CALLOUT_SEED"]) == dotenv["PARLEY_NATS_CALLOUT_ISSUER"]


@dataclass
class DeployedNode:
    name: str
    port: int
    monitor: int
    route: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


@dataclass
class DeployedCluster:
    nodes: list[DeployedNode]
    dotenv: dict[str, str]

    @property
    def url(self) -> str:
        return self.nodes[0].url


def meta(node: DeployedNode) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor}/jsz", timeout=2) as response:
        found = json.loads(response.read()).get("meta_cluster") or {}
    return found if isinstance(found, dict) else {}


@pytest.fixture(scope="module")
def deployed_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeployedCluster]:
    """The three-node cluster docker-compose runs: three nats-servers started from deploy/nats.conf
    and deploy/nats-auth.conf (ports and stores moved), each with the environment compose gives its
    node (docker-compose.yml's x-nats-env, its name, the routes on this machine's ports) and the
    secrets of a `.env` from tools/gen_secrets.py."""
    dotenv = dict(
        line.split("=", 1)
        for line in tool("gen_secrets").render().splitlines()
        if line and not line.startswith("#")
    )
    compose = yaml.safe_load(COMPOSE.read_text())
    nodes = [DeployedNode(name, free_port(), free_port(), free_port()) for name in NATS_NODES]
    config = (ROOT / "deploy" / "nats.conf").read_text()
    assert "store_dir: /data" in config
    assert "listen: 0.0.0.0:6222" in config
    root = tmp_path_factory.mktemp("deployed-nats")
    try:
        for node in nodes:
            env = node_environment(compose, node.name, dotenv)
            for index, other in enumerate(nodes, start=1):
                # Compose's route URLs, pointed at this machine's ports instead of the compose network.
                route = env[f"PARLEY_NATS_ROUTE_{index}"]
                assert route.endswith(f"@{other.name}:6222"), route
                env[f"PARLEY_NATS_ROUTE_{index}"] = route.replace(
                    f"@{other.name}:6222", f"@127.0.0.1:{other.route}"
                )
            # The deployed files, with only JetStream's store and the route listener moved (the server
            # refuses `-sd` beside `store_dir`, and `--cluster` would replace the cluster block's
            # authorization with its URL's: none).
            folder = root / node.name
            folder.mkdir()
            moved = config.replace("store_dir: /data", f'store_dir: "{folder / "data"}"')
            moved = moved.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{node.route}")
            (folder / "nats.conf").write_text(moved)
            (folder / "nats-auth.conf").write_text(AUTH_CONF.read_text())
            with (folder / "nats.log").open("wb") as log:
                node.process = subprocess.Popen(
                    [
                        str(nats_server_binary()),
                        "-c",
                        str(folder / "nats.conf"),
                        "-p",
                        str(node.port),
                        "-m",
                        str(node.monitor),
                        "-a",
                        "127.0.0.1",
                    ],
                    env={**os.environ, **env},
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
        operator = dotenv["PARLEY_OPERATOR_NATS_PASSWORD"]

        async def formed() -> bool:
            for node in nodes:
                assert node.process is not None
                assert node.process.poll() is None, (root / node.name / "nats.log").read_text()[-2000:]
                if await refused(node.url, user="operator", password=operator):
                    return False
            try:
                views = [meta(node) for node in nodes]
            except OSError:
                return False
            return len({v.get("leader") for v in views}) == 1 and all(
                v.get("leader") and v.get("cluster_size") == len(nodes) for v in views
            )

        asyncio.run(eventually(formed, timeout=30, what="the deployed three-node cluster"))
        yield DeployedCluster(nodes, dotenv)
    finally:
        for node in nodes:
            if node.process is not None:
                node.process.terminate()
                node.process.wait(timeout=10)


def node_environment(compose: dict[str, Any], name: str, dotenv: dict[str, str]) -> dict[str, str]:
    """The environment compose gives NATS node ``name``, its ``${VAR:?…}`` references resolved from
    ``dotenv`` as compose would."""

    def resolve(value: object) -> str:
        def one(match: re.Match[str]) -> str:
            assert match.group(1) in dotenv, f"{name} needs {match.group(1)}, which .env lacks"
            return dotenv[match.group(1)]

        return re.sub(r"\$\{([A-Z0-9_]+):\?[^}]*\}", one, str(value))

    env = compose["services"][name]["environment"]
    return {key: resolve(value) for key, value in env.items()}


async def refused(url: str, **credentials: str) -> bool:
    nc = Client()
    try:
        await nc.connect(url, allow_reconnect=False, connect_timeout=5, **credentials)  # type: ignore[arg-type]
    except (nats.errors.Error, OSError, TimeoutError):
        return True
    finally:
        await nc.close()  # a refused connection leaves its socket open otherwise
    return False


def test_deployed_server_admits_each_identity_with_its_own_password_only(
    deployed_nats: DeployedCluster,
) -> None:
    dotenv = deployed_nats.dotenv

    async def check() -> None:
        for url in (node.url for node in deployed_nats.nodes):
            await check_node(url)

    async def check_node(url: str) -> None:
        for name in permissions.IDENTITIES:
            password = dotenv[f"PARLEY_{name.upper()}_NATS_PASSWORD"]
            assert not await refused(url, user=name, password=password), name
            other = next(n for n in permissions.IDENTITIES if n != name)
            wrong = dotenv[f"PARLEY_{other.upper()}_NATS_PASSWORD"]
            assert await refused(url, user=name, password=wrong), f"{name} with {other}'s password"
        assert await refused(url), "anonymous"
        assert await refused(url, user="intruder", password="guess"), (
            "an unknown user without a pairing service"
        )

    asyncio.run(check())


def test_deployed_server_enforces_the_identities_permissions(
    deployed_nats: DeployedCluster,
) -> None:
    url, dotenv = deployed_nats.nodes[-1].url, deployed_nats.dotenv

    async def check() -> None:
        errors: list[str] = []

        async def on_error(error: Exception) -> None:
            errors.append(str(error).lower())

        nc = await nats.connect(
            url, user="model", password=dotenv["PARLEY_MODEL_NATS_PASSWORD"], error_cb=on_error
        )
        try:
            await nc.publish("parley.inbound.agent.telegram", b"forged")
            await nc.publish("parley.model.budget.changed", b"allowed")
            await nc.flush()

            async def refusal() -> bool:
                return any("parley.inbound.agent.telegram" in e for e in errors)

            await eventually(refusal, what="the server refusing the model's forged inbound message")
            assert not any("budget.changed" in e for e in errors), errors
        finally:
            await nc.close()

    asyncio.run(check())


def test_the_deployed_cluster_keeps_three_copies_of_a_stream(deployed_nats: DeployedCluster) -> None:
    """A stream created through one node with three replicas lives on all three, and a message
    published through one node is read back through another."""

    async def check() -> None:
        password = deployed_nats.dotenv["PARLEY_OPERATOR_NATS_PASSWORD"]
        first = await nats.connect(deployed_nats.nodes[0].url, user="operator", password=password)
        last = await nats.connect(deployed_nats.nodes[-1].url, user="operator", password=password)
        name, subject = f"DEPLOYED_{uuid.uuid4().hex[:8].upper()}", f"deployed.{uuid.uuid4().hex[:8]}"
        try:
            await first.jetstream().add_stream(name=name, subjects=[subject], num_replicas=3)
            info = await first.jetstream().stream_info(name)
            assert info.cluster is not None
            members = {info.cluster.leader, *(peer.name for peer in info.cluster.replicas or [])}
            assert members == set(NATS_NODES)
            ack = await first.jetstream().publish(subject, b"kept")
            stored = await last.jetstream().get_msg(name, ack.seq)
            assert stored.data == b"kept"
            await first.jetstream().delete_stream(name)
        finally:
            await first.close()
            await last.close()

    asyncio.run(check())


def route_answer(node: DeployedNode, password: str) -> bytes:
    """What ``node``'s route port answers a server that connects with the route user and ``password``."""
    with socket.create_connection(("127.0.0.1", node.route), timeout=5) as sock:
        assert sock.recv(4096).startswith(b"INFO ")
        connect = {
            "user": "route",
            "pass": password,
            "name": "intruder",
            "cluster": "parley",
            "headers": True,
        }
        sock.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while b"\r\n" not in answer:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
    return answer


def test_the_deployed_routes_admit_only_servers_with_the_route_password(
    deployed_nats: DeployedCluster,
) -> None:
    node = deployed_nats.nodes[0]
    assert b"Authorization Violation" in route_answer(node, "not-the-route-password")
    assert route_answer(node, deployed_nats.dotenv["PARLEY_NATS_ROUTE_PASSWORD"]).startswith(b"PONG")
