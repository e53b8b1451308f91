"""Session fixtures: real NATS and PostgreSQL for every test, isolated per session.

NATS is an embedded server configured from parley_platform.permissions (or
PARLEY_TEST_NATS_URL with its PARLEY_TEST_NATS_AUTH credentials); PostgreSQL comes
from PARLEY_TEST_DATABASE_URL when set, else from testcontainers when a Docker
engine answers, else from the embedded binaries of the pip packages. The tests'
own clients connect as the operator; each service process as itself. Each
session gets its own database and its own NATS namespace (subjects and stream
names), so runs never collide.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

from parley_devinfra import infra
from parley_devinfra.cluster import NatsCluster
from parley_devinfra.natsauth import CONFIG_FILE, NatsAuth
from parley_platform.bus import Bus, standard_streams
from parley_platform.testing import create_database, drop_database
from support import SessionEnv, cluster_env


@pytest.fixture(scope="session")
def endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[infra.Endpoints]:
    with infra.session_infra(tmp_path_factory.mktemp("infra")) as found:
        yield found


@pytest.fixture(scope="session")
def test_env(endpoints: infra.Endpoints) -> Iterator[SessionEnv]:
    suffix = secrets.token_hex(4)
    name = f"parley_test_{suffix}"
    url = create_database(endpoints.database_url, name)
    yield SessionEnv(
        nats_url=endpoints.nats_url_for("operator"),
        server_database_url=endpoints.database_url,
        database_url=url,
        namespace=f"t{suffix}",
        token=secrets.token_urlsafe(24),
        endpoints=endpoints,
    )
    drop_database(endpoints.database_url, name)


@pytest.fixture(scope="session")
async def bus(test_env: SessionEnv) -> AsyncIterator[Bus]:
    connected = await Bus.connect(test_env.nats_url, name="tests", namespace=test_env.namespace)
    await connected.ensure_standard_streams()
    yield connected
    for spec in standard_streams(connected.subjects):
        with contextlib.suppress(Exception):
            await connected.js.delete_stream(spec.name)
    await connected.close()


@pytest.fixture
def fresh_database(test_env: SessionEnv) -> Iterator[str]:
    """An empty database of its own, for tests that need one (migrations, schema)."""
    name = f"parley_fresh_{secrets.token_hex(4)}"
    url = create_database(test_env.server_database_url, name)
    yield url
    drop_database(test_env.server_database_url, name)


@pytest.fixture
def nats_cluster(
    test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[NatsCluster, SessionEnv]]:
    """A three-node NATS cluster of this test's own (three nats-server processes, the session's
    permissions and fresh credentials), and the session's environment pointed at it: every URL
    lists the three nodes, the namespace is new, the database is the session's."""
    root = tmp_path_factory.mktemp("cluster")
    NatsAuth.ensure(root / "auth")
    cluster = NatsCluster(root, config_file=root / "auth" / CONFIG_FILE)
    try:
        cluster.start()
        yield cluster, cluster_env(test_env, cluster.url, NatsAuth.load(root / "auth" / "auth.json"))
    finally:
        cluster.stop()
