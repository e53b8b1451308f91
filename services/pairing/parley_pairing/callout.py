"""NATS auth callout: the pairing service decides which connectors may connect, and with what.

Every NATS user that is not a configured identity (a service, the operator) is a connector: the
server sends its credentials to ``$SYS.REQ.USER.AUTH`` (a queue group of the pairing replicas),
and the answer is a user JWT carrying the connector's permissions
(``parley_platform.permissions.connector``), signed with the issuer key the server trusts, or a
refusal. The connection is recorded with the same statement that admits it, so a revocation closes
it through NATS' system account (``$SYS.REQ.SERVER.<id>.KICK``) within the time of one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import nkeys
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter

from parley_platform import permissions
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from . import natsjwt
from .connectors import digest
from .store import ConnectorStore, Session

log = get_logger(__name__)

QUEUE = "pairing-auth"
REFUSED = "not a connector of this deployment, or revoked"


class CalloutMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.admissions = Counter(
            "parley_pairing_connector_admissions_total",
            "NATS connections of connectors, admitted or refused",
            ["outcome"],
            registry=registry,
        )


class Callout:
    """Answers the server's authorization requests (a host component)."""

    def __init__(self, bus: Bus, store: ConnectorStore, issuer_seed: str, metrics: CalloutMetrics) -> None:
        self.bus = bus
        self.store = store
        self.issuer = nkeys.from_seed(issuer_seed.encode())
        self.metrics = metrics
        self._sub: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sub = await self.bus.nc.subscribe(permissions.AUTH_SUBJECT, queue=QUEUE, cb=self._on_request)
        log.info("connector admission serving", subject=permissions.AUTH_SUBJECT)

    async def stop(self, timeout: float) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def _on_request(self, msg: Msg) -> None:
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            request = natsjwt.decode(msg.data.decode())
            nats = request["nats"]
            user_nkey, server_id = str(nats["user_nkey"]), str(nats["server_id"]["id"])
            client_id = int(nats.get("client_info", {}).get("id", 0))
            options = nats.get("connect_opts", {})
        except (natsjwt.JwtError, KeyError, TypeError, ValueError, UnicodeDecodeError):
            self.metrics.admissions.labels("malformed").inc()
            log.warning("authorization request not understood; no answer")
            return
        name, password = str(options.get("user", "")), str(options.get("pass", ""))
        try:
            connector = await self.store.admit(name, digest(password), Session(server_id, client_id))
        except ParleyError as exc:
            # The database is away: refuse (fail closed); the connector's client retries.
            self.metrics.admissions.labels("unavailable").inc()
            log.warning("connector admission failed closed", code=exc.code)
            await self._respond(msg, natsjwt.response_claims(user_nkey, server_id, error="try again later"))
            return
        if connector is None:
            self.metrics.admissions.labels("refused").inc()
            log.info("connector refused", user=name[:64])
            await self._respond(msg, natsjwt.response_claims(user_nkey, server_id, error=REFUSED))
            return
        allowed = connector.permissions()
        user_jwt = natsjwt.encode(
            natsjwt.user_claims(
                user_nkey,
                name=connector.name,
                account=permissions.ACCOUNT,
                publish=list(allowed.publish),
                subscribe=list(allowed.subscribe),
            ),
            self.issuer,
        )
        self.metrics.admissions.labels("admitted").inc()
        log.info("connector admitted", connector=connector.name, source=connector.source)
        await self._respond(msg, natsjwt.response_claims(user_nkey, server_id, user_jwt=user_jwt))

    async def _respond(self, msg: Msg, claims: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            await self.bus.nc.publish(msg.reply, natsjwt.encode(claims, self.issuer).encode())


class Kicker:
    """Closes NATS connections through the system account."""

    def __init__(self, system: Bus | None) -> None:
        self.system = system

    async def close(self, sessions: list[Session]) -> int:
        """Ask each connection's server to close it; the number it confirmed closed."""
        if self.system is None:
            return 0
        closed = 0
        for session in sessions:
            subject = f"$SYS.REQ.SERVER.{session.server_id}.KICK"
            try:
                reply = await self.system.nc.request(
                    subject, json.dumps({"cid": session.client_id}).encode(), timeout=2
                )
            except Exception as exc:
                log.warning(
                    "connector connection not closed", server=session.server_id, error=type(exc).__name__
                )
                continue
            answer = json.loads(reply.data or b"{}")
            if not answer.get("error"):
                closed += 1
        return closed
