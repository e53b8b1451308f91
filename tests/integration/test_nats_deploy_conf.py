"""The deployed NATS configuration (deploy/nats.conf + the generated deploy/nats-auth.conf) is the one
the code defines, docker-compose hands every secret to the server and each service only its own, and
a real nats-server started from those files with a `.env` from tools/gen_secrets.py admits each
identity with its own password, refuses wrong or missing credentials, and enforces permissions."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import subprocess
from collections.abc import Iterator
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


def test_compose_gives_nats_every_secret_its_config_reads(compose: dict[str, Any]) -> None:
    nats_service = compose["services"]["nats"]
    env = nats_service.get("environment") or {}
    for ref in env_refs(AUTH_CONF.read_text()):
        assert env.get(ref) == f"${{{ref}:?run make secrets}}", f"nats needs {ref}, required"
    mounts = {volume.split(":")[1] for volume in nats_service["volumes"] if volume.startswith("./")}
    assert "/etc/nats/nats-auth.conf" in mounts, "the include must sit beside the mounted nats.conf"


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


@pytest.fixture(scope="module")
def deployed_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """nats-server started from deploy/nats.conf (ports and store moved), its secrets from gen_secrets."""
    dotenv = dict(
        line.split("=", 1)
        for line in tool("gen_secrets").render().splitlines()
        if line and not line.startswith("#")
    )
    port, monitor = free_port(), free_port()
    # The deployed files, with only JetStream's store moved (the server refuses `-sd` beside `store_dir`).
    folder = tmp_path_factory.mktemp("deployed-nats")
    config = (ROOT / "deploy" / "nats.conf").read_text()
    assert "store_dir: /data" in config
    (folder / "nats.conf").write_text(config.replace("store_dir: /data", f'store_dir: "{folder / "data"}"'))
    (folder / "nats-auth.conf").write_text(AUTH_CONF.read_text())
    process = subprocess.Popen(
        [
            str(nats_server_binary()),
            "-c",
            str(folder / "nats.conf"),
            "-p",
            str(port),
            "-m",
            str(monitor),
            "-a",
            "127.0.0.1",
        ],
        env={**os.environ, **dotenv},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"nats://127.0.0.1:{port}"

        async def up() -> bool:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else "exited"
            return not await refused(url, user="operator", password=dotenv["PARLEY_OPERATOR_NATS_PASSWORD"])

        asyncio.run(eventually(up, timeout=15, what="the deployed nats-server"))
        yield url, dotenv
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stderr:
            process.stderr.close()


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
    deployed_nats: tuple[str, dict[str, str]],
) -> None:
    url, dotenv = deployed_nats

    async def check() -> None:
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
    deployed_nats: tuple[str, dict[str, str]],
) -> None:
    url, dotenv = deployed_nats

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
