"""The embedded NATS and Postgres servers: start, reuse, stop, restart, pass-through and clean-up."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import nats
import psycopg
import pytest

from parley_devinfra import infra
from parley_devinfra.infra import Endpoints, InfraError

DEADLINE = 20.0


def wait_for(predicate: Callable[[], bool], timeout: float = DEADLINE) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def port_closed(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


def record(state_dir: Path, name: str) -> dict[str, object]:
    entry = infra.status(state_dir)[name]
    assert isinstance(entry, dict)
    return entry


async def jetstream_roundtrip(url: str) -> tuple[bytes, int]:
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        await js.add_stream(name="T", subjects=["t.>"])
        ack = await js.publish("t.x", b"hello")
        message = await js.get_msg("T", ack.seq)
        info = await js.stream_info("T")
        return message.data or b"", info.state.messages
    finally:
        await nc.close()


def postgres_roundtrip(url: str) -> float:
    with psycopg.connect(url, connect_timeout=5) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        row = conn.execute("SELECT '[1,2,3]'::vector <-> '[1,2,4]'::vector").fetchone()
    assert row is not None
    return float(row[0])


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A folder the postgres OS user can traverse (pytest's tmp_path is 0700 under root)."""
    root = Path(tempfile.mkdtemp(prefix="parley-infra-test-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def state_dirs(scratch: Path) -> Iterator[Callable[[str], Path]]:
    """State directories whose servers are stopped after the test, whatever happened."""
    made: list[Path] = []

    def make(name: str) -> Path:
        made.append(scratch / name)
        return scratch / name

    try:
        yield make
    finally:
        for state_dir in reversed(made):
            infra.down(state_dir)


def test_up_is_idempotent_and_survives_down_up(state_dirs: Callable[[str], Path]) -> None:
    state_dir = state_dirs("state")
    first = infra.up(state_dir)
    assert first.nats_embedded
    assert first.postgres_embedded
    assert first.nats_monitor_url is not None
    assert asyncio.run(jetstream_roundtrip(first.nats_url_for("operator"))) == (b"hello", 1)
    assert postgres_roundtrip(first.database_url) == 1.0
    with psycopg.connect(first.database_url) as conn:
        conn.execute("CREATE TABLE kept (id int PRIMARY KEY)")
        conn.execute("INSERT INTO kept VALUES (42)")

    nats_pid, pg_pid = record(state_dir, "nats")["pid"], record(state_dir, "postgres")["pid"]
    assert isinstance(nats_pid, int)
    assert isinstance(pg_pid, int)
    assert infra.up(state_dir) == first
    assert (record(state_dir, "nats")["pid"], record(state_dir, "postgres")["pid"]) == (nats_pid, pg_pid)
    assert infra.read_endpoints(state_dir) == first
    for name in ("nats", "postgres"):
        entry = record(state_dir, name)
        assert (entry["embedded"], entry["running"], entry["healthy"]) == (True, True, True), entry

    assert sorted(infra.down(state_dir)) == ["nats", "postgres"]
    assert not infra.process_alive(nats_pid)
    assert not infra.process_alive(pg_pid)
    ports = [port_of(first.nats_url), port_of(first.database_url), port_of(first.nats_monitor_url)]
    assert wait_for(lambda: all(port_closed(port) for port in ports))
    for name in ("nats", "postgres"):
        entry = record(state_dir, name)
        assert (entry["pid"], entry["running"], entry["healthy"]) == (None, False, False), entry
    assert infra.down(state_dir) == []

    second = infra.up(state_dir)
    assert second == first
    assert record(state_dir, "nats")["pid"] != nats_pid
    assert asyncio.run(jetstream_roundtrip(second.nats_url_for("operator"))) == (b"hello", 2)
    with psycopg.connect(second.database_url) as conn:
        assert conn.execute("SELECT id FROM kept").fetchall() == [(42,)]


def test_up_restarts_servers_that_died(state_dirs: Callable[[str], Path]) -> None:
    state_dir = state_dirs("state")
    first = infra.up(state_dir)
    pids = [record(state_dir, name)["pid"] for name in ("nats", "postgres")]
    for pid in pids:
        assert isinstance(pid, int)
        os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not any(infra.process_alive(pid) for pid in pids if isinstance(pid, int)))
    assert not record(state_dir, "nats")["running"]
    assert not record(state_dir, "postgres")["running"]

    again = infra.up(state_dir)
    assert again == first
    assert [record(state_dir, name)["pid"] for name in ("nats", "postgres")] != pids
    assert asyncio.run(jetstream_roundtrip(again.nats_url_for("operator")))[0] == b"hello"
    assert postgres_roundtrip(again.database_url) == 1.0


def test_up_moves_off_a_recorded_port_taken_meanwhile(state_dirs: Callable[[str], Path]) -> None:
    state_dir = state_dirs("state")
    first = infra.up(state_dir)
    infra.down(state_dir)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port_of(first.nats_url)))
        squatter.listen()
        moved = infra.up(state_dir)
    assert moved.nats_url != first.nats_url
    assert moved.database_url == first.database_url
    assert asyncio.run(jetstream_roundtrip(moved.nats_url_for("operator")))[0] == b"hello"


def test_external_urls_are_passed_through(state_dirs: Callable[[str], Path]) -> None:
    owner_dir = state_dirs("owner")
    servers = infra.up(owner_dir)
    user_dir = state_dirs("user")

    passed = infra.up(user_dir, nats_url=servers.nats_url, database_url=servers.database_url)
    assert passed == Endpoints(
        nats_url=servers.nats_url,
        database_url=servers.database_url,
        nats_embedded=False,
        postgres_embedded=False,
    )
    assert sorted(path.name for path in user_dir.iterdir()) == ["infra.json", "infra.lock"]
    for name in ("nats", "postgres"):
        entry = record(user_dir, name)
        assert (entry["embedded"], entry["pid"], entry["healthy"]) == (False, None, True), entry
    assert postgres_roundtrip(passed.database_url) == 1.0

    assert infra.down(user_dir) == []
    for name in ("nats", "postgres"):
        assert record(owner_dir, name)["running"]


@pytest.mark.parametrize("service", ["nats", "postgres"])
def test_a_busy_requested_port_fails_naming_it(state_dirs: Callable[[str], Path], service: str) -> None:
    state_dir = state_dirs("state")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(InfraError) as caught:
            infra.up(state_dir, **{f"{service}_port": port})
    assert caught.value.code == "INFRA_UNAVAILABLE"
    assert str(port) in str(caught.value)
    assert f"{service}_port" in str(caught.value)
    for name in ("nats", "postgres"):
        assert not record(state_dir, name)["running"]
    assert not (state_dir / "postgres" / "postmaster.pid").exists()


def test_session_infra_stops_its_servers(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PARLEY_TEST_NATS_URL", "PARLEY_TEST_NATS_AUTH", *infra.TEST_DATABASE_URL_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(infra, "docker_engine_available", lambda: False)

    with infra.session_infra(scratch / "session") as endpoints:
        assert endpoints.nats_embedded
        assert endpoints.postgres_embedded
        assert asyncio.run(jetstream_roundtrip(endpoints.nats_url_for("operator")))[0] == b"hello"
        assert postgres_roundtrip(endpoints.database_url) == 1.0

        # An external server is used only with the credentials it was configured with.
        monkeypatch.setenv("PARLEY_TEST_NATS_URL", endpoints.nats_url)
        monkeypatch.setenv("PARLEY_TEST_NATS_AUTH", str(scratch / "session" / infra.AUTH_DIR / "auth.json"))
        monkeypatch.setenv("PARLEY_DATABASE_URL", endpoints.database_url)
        with infra.session_infra(scratch / "nested") as nested:
            assert nested == Endpoints(
                nats_url=endpoints.nats_url,
                database_url=endpoints.database_url,
                nats_embedded=False,
                postgres_embedded=False,
                nats_auth=endpoints.nats_auth,
            )
        assert list((scratch / "nested").iterdir()) == []
    ports = [port_of(endpoints.nats_url), port_of(endpoints.database_url)]
    assert wait_for(lambda: all(port_closed(port) for port in ports))
    assert not (scratch / "session" / "postgres" / "postmaster.pid").exists()


def test_session_infra_stops_its_servers_on_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PARLEY_TEST_NATS_URL", "PARLEY_TEST_NATS_AUTH", *infra.TEST_DATABASE_URL_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(infra, "docker_engine_available", lambda: False)

    ports: list[int] = []

    def fail_inside_session() -> None:
        with infra.session_infra(tmp_path / "session") as endpoints:
            ports.extend([port_of(endpoints.nats_url), port_of(endpoints.database_url)])
            assert postgres_roundtrip(endpoints.database_url) == 1.0
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside_session()
    assert len(ports) == 2
    assert wait_for(lambda: all(port_closed(port) for port in ports))
