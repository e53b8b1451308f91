"""TLS on both transports, as settings: a real service process connects to a nats-server that
requires TLS and client certificates (PARLEY_NATS_TLS_CA/CERT/KEY) and serves gRPC over TLS only
(PARLEY_GRPC_TLS_CERT/KEY); the operator reaches it through both with the CA (PARLEY_GRPC_TLS_CA
for the CLI's channel), and plaintext or certificate-less connections are refused."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import nats.errors
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nats.aio.client import Client

from parley.v1 import pairing_pb2, pairing_pb2_grpc
from parley.v1.pairing_nats import PairingClient
from parley_devinfra.infra import free_port, nats_server_binary
from parley_devinfra.natsauth import NatsAuth
from parley_platform.bus import Bus, tls_context
from parley_platform.grpcserver import open_channel
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess, eventually
from support import SessionEnv


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def make_pki(folder: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, signed by it."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "parley test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(name: str, usage: x509.ObjectIdentifier) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = _key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        )
        return builder.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH)
    client, client_key = leaf("parley-client", ExtendedKeyUsageOID.CLIENT_AUTH)
    pki = Pki(
        ca=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server-key.pem",
        client_cert=folder / "client.pem",
        client_key=folder / "client-key.pem",
    )
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    pki.client_cert.write_bytes(client.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.server_key, server_key)
    _write_key(pki.client_key, client_key)
    return pki


@dataclass(frozen=True)
class TlsNats:
    url: str
    auth: NatsAuth
    pki: Pki


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsNats]:
    """nats-server with the suite's identities, TLS only, client certificates required."""
    folder = tmp_path_factory.mktemp("tls")
    pki = make_pki(folder)
    auth = NatsAuth.ensure(folder / "auth")
    port = free_port()
    process = subprocess.Popen(
        [
            str(nats_server_binary()),
            "-c",
            str(folder / "auth" / "nats.conf"),
            "-js",
            "-sd",
            str(folder / "js"),
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
            "--tlsverify",
            "--tlscert",
            str(pki.server_cert),
            "--tlskey",
            str(pki.server_key),
            "--tlscacert",
            str(pki.ca),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while not port_taken(port):
            assert process.poll() is None, "nats-server with TLS exited"
            assert time.monotonic() < deadline, "nats-server with TLS did not start"
            time.sleep(0.05)
        yield TlsNats(f"tls://127.0.0.1:{port}", auth, pki)
    finally:
        process.terminate()
        process.wait(timeout=10)


def port_taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def connects(url: str, **options: object) -> bool:
    nc = Client()
    try:
        await nc.connect(url, allow_reconnect=False, connect_timeout=3, **options)  # type: ignore[arg-type]
    except (nats.errors.Error, OSError, TimeoutError):
        return False
    finally:
        await nc.close()
    return True


@pytest.fixture
async def pairing_over_tls(
    tls_nats: TlsNats, test_env: SessionEnv, tmp_path: Path
) -> Iterator[tuple[ServiceProcess, str]]:
    pki, namespace = tls_nats.pki, f"tls{secrets.token_hex(3)}"
    port = free_port()
    env = {
        **tls_nats.auth.services_env(),
        "PARLEY_NATS_URL": tls_nats.url,
        "PARLEY_NATS_TLS_CA": str(pki.ca),
        "PARLEY_NATS_TLS_CERT": str(pki.client_cert),
        "PARLEY_NATS_TLS_KEY": str(pki.client_key),
        "PARLEY_GRPC_TLS_CERT": str(pki.server_cert),
        "PARLEY_GRPC_TLS_KEY": str(pki.server_key),
        "PARLEY_DATABASE_URL": test_env.database_url,
        "PARLEY_NAMESPACE": namespace,
        "PARLEY_OPERATOR_TOKEN": test_env.token,
        "PARLEY_ENVIRONMENT": "test",
        "PARLEY_PAIRING_GRPC_PORT": str(port),
        "PARLEY_PAIRING_METRICS_PORT": str(free_port()),
    }
    process = ServiceProcess(
        "parley_pairing", env, tmp_path / "pairing.log", port, grpc_tls_ca=pki.ca
    ).start()
    try:
        await process.wait_ready()
        yield process, namespace
    finally:
        process.stop()


async def plaintext_session(url: str, user: str, password: str) -> bytes:
    """What the server answers a client that speaks NATS without TLS (raw protocol over TCP)."""
    host, _, port = url.removeprefix("tls://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        info = await asyncio.wait_for(reader.readline(), 5)
        assert b'"tls_required":true' in info, info
        connect = json.dumps({"user": user, "pass": password, "verbose": False, "pedantic": False})
        writer.write(f"CONNECT {connect}\r\nPING\r\n".encode())
        await writer.drain()
        return await asyncio.wait_for(reader.read(4096), 5)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def test_nats_refuses_plaintext_and_clients_without_a_certificate(tls_nats: TlsNats) -> None:
    pki, password = tls_nats.pki, tls_nats.auth.passwords["operator"]
    answer = await plaintext_session(tls_nats.url, "operator", password)
    # The server hangs up on a client that does not start TLS: no PONG, the session is over.
    assert b"PONG" not in answer, answer
    assert answer == b"" or answer.startswith(b"-ERR"), answer
    no_cert = tls_context(pki.ca)
    assert not await connects(tls_nats.url, user="operator", password=password, tls=no_cert), "no client cert"
    assert await connects(
        tls_nats.url,
        user="operator",
        password=password,
        tls=tls_context(pki.ca, pki.client_cert, pki.client_key),
    )


async def test_a_service_runs_on_tls_nats_and_serves_grpc_over_tls_only(
    tls_nats: TlsNats, pairing_over_tls: tuple[ServiceProcess, str], test_env: SessionEnv
) -> None:
    process, namespace = pairing_over_tls
    pki = tls_nats.pki
    # gRPC: with the CA, the operator's call is answered; a plaintext channel gets nowhere.
    metadata = (("authorization", f"Bearer {test_env.token}"),)
    async with open_channel(f"127.0.0.1:{process.grpc_port}", tls_ca=pki.ca) as channel:
        reply = await pairing_pb2_grpc.PairingStub(channel).ListConnectors(
            pairing_pb2.ListConnectorsRequest(), metadata=metadata, timeout=10
        )
        assert list(reply.connectors) == []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{process.grpc_port}") as plain:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # NATS: the service serves its RPCs on the TLS server, answering the operator's request.
    bus = await Bus.connect(
        tls_nats.url,
        name="tls-test",
        namespace=namespace,
        user="operator",
        password=tls_nats.auth.passwords["operator"],
        tls=tls_context(pki.ca, pki.client_cert, pki.client_key),
    )
    try:
        pairing = PairingClient(RpcClient(bus), timeout=5)

        async def answered() -> bool:
            reply = await pairing.ListConnectors(pairing_pb2.ListConnectorsRequest())
            return isinstance(reply, pairing_pb2.ListConnectorsResponse)

        assert await eventually(answered, what="pairing answering over TLS NATS")
    finally:
        await bus.close()
