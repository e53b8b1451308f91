"""A runtime killed while the model streams its reply: the gateway notices its caller is gone (no
more pings) and closes the provider's stream instead of generating for nobody."""

from __future__ import annotations

import asyncio

from parley.v1 import runtime_pb2
from parley_platform.testing import eventually
from support import DEFAULT_AGENT_ID, Suite, inbound, publish_inbound


async def test_a_killed_runtime_stops_the_providers_stream(isolated_suite: Suite) -> None:
    suite = await isolated_suite.start(runtimes=1)
    assert suite.gateway is not None
    bus = await suite.connect()
    first = asyncio.Event()

    async def on_chunk(msg: object) -> None:
        if runtime_pb2.StreamChunk.FromString(msg.data).delta:  # type: ignore[attr-defined]
            first.set()

    try:
        await bus.subscribe(bus.subjects.chunks(DEFAULT_AGENT_ID, "e2e"), on_chunk)
        await publish_inbound(bus, inbound("please stream slowly"))
        async with asyncio.timeout(30):
            await first.wait()
        suite.runtime.kill()
        gateway = suite.gateway

        async def cancelled() -> bool | None:
            return True if "scripted stream cancelled" in gateway.log(tail=100000) else None

        # The stream would run about 12 s more; without pings the gateway gives up after 10 s.
        await eventually(cancelled, timeout=25, what="the provider's stream closed")
        assert "stream abandoned" in gateway.log(tail=100000)
    finally:
        await bus.close()
