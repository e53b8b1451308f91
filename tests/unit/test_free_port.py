"""``free_port`` hands out each port once per process: the kernel may offer the same free port to
two calls in a row (nothing listens on it yet), and a suite given one port twice fails to start
(seen in CI: the web connector's metrics port was the model gateway's)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from parley_devinfra import infra


class OfferedPorts:
    """A socket whose kernel offers these ports, in turn, to bind((host, 0))."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def __call__(self, *args: Any, **kwargs: Any) -> OfferedPorts.Socket:
        return OfferedPorts.Socket(self.ports.pop(0))

    class Socket:
        def __init__(self, port: int) -> None:
            self.port = port

        def __enter__(self) -> OfferedPorts.Socket:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def bind(self, address: tuple[str, int]) -> None:
            assert address[1] == 0

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)


def test_a_port_offered_again_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(infra, "_HANDED_OUT", set())
    monkeypatch.setattr(infra.socket, "socket", OfferedPorts([40001, 40001, 40001, 40002]))
    assert infra.free_port() == 40001
    assert infra.free_port() == 40002


def test_many_ports_are_all_different_and_free() -> None:
    ports = [infra.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    for port in ports[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((infra.HOST, port))  # nothing holds it
