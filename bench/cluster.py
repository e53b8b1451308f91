"""What three copies of every stream cost, and how long a stream is unwritable when its leader dies.

A local three-node NATS cluster (parley_devinfra.cluster, the suite's permissions) keeps a stream
with three replicas; the floor, in the same run, is the same stream with one replica on one
nats-server configured alike. Both take JetStream publishes acknowledged by the server (what every
Parley publish waits for): sequentially, then ``--in-flight`` at once. Then, ``--failovers`` times,
a steady publisher writes to the replicated stream while its leader is SIGKILLed: the figure is how
long publishes went unacknowledged, and the node is restarted before the next round.

Usage: python bench/cluster.py [--sequential 500] [--concurrent 5000] [--in-flight 64] [--failovers 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from _common import Series, report

from parley_devinfra.cluster import NatsCluster
from parley_devinfra.infra import EmbeddedNats
from parley_devinfra.natsauth import CONFIG_FILE, NatsAuth
from parley_platform.bus import Bus, StreamSpec
from parley_platform.errors import ParleyError

NAMESPACE = "bench"


async def publishes(bus: Bus, subject: str, n: int, in_flight: int, name: str) -> Series:
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    payload = b"x" * 256  # about an inbound message's size

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            await bus.publish(subject, payload, msg_id=f"{name}-{i}")
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return Series(name, latencies, time.perf_counter() - started)


async def measure(url: str, replicas: int, label: str, args: argparse.Namespace) -> list[Series]:
    bus = await Bus.connect(url, name="bench-cluster", namespace=NAMESPACE)
    try:
        spec = StreamSpec(f"BENCH_R{replicas}", [f"{NAMESPACE}.r{replicas}.>"], replicas=replicas)
        await bus.ensure_stream(spec)
        subject = f"{NAMESPACE}.r{replicas}.x"
        await publishes(bus, subject, min(50, args.sequential), 1, f"{label}-warm")
        return [
            await publishes(bus, subject, args.sequential, 1, f"{label} sequential"),
            await publishes(
                bus, subject, args.concurrent, args.in_flight, f"{label} {args.in_flight} in flight"
            ),
        ]
    finally:
        await bus.close()


async def failover(cluster: NatsCluster, url: str) -> float:
    """Seconds a steady publisher (one publish at a time, each retried until acknowledged) goes
    without an acknowledgement after the replicated stream's leader is SIGKILLed."""
    bus = await Bus.connect(url, name="bench-failover", namespace=NAMESPACE)
    try:
        info = await bus.js.stream_info("BENCH_R3")
        assert info.cluster is not None
        assert info.cluster.leader is not None
        victim = cluster.node(info.cluster.leader)
        victim.kill()
        killed = time.perf_counter()
        index = 0
        while True:
            try:
                await bus.publish(
                    f"{NAMESPACE}.r3.failover", b"x", msg_id=f"failover-{killed}-{index}", timeout=1
                )
                break
            except ParleyError:
                index += 1
        gap = time.perf_counter() - killed
        await asyncio.to_thread(cluster.restart, victim)
        return gap
    finally:
        await bus.close()


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="parley-bench-cluster-"))
    auth = NatsAuth.ensure(root / "auth")
    single = EmbeddedNats(
        root / "single", log_file=root / "logs" / "single.log", config_file=root / "auth" / CONFIG_FILE
    )
    cluster = NatsCluster(root / "cluster", config_file=root / "auth" / CONFIG_FILE)
    try:
        single.start()
        await asyncio.to_thread(cluster.start)
        floor = await measure(auth.url(single.url, "operator"), 1, "R1, one server (floor)", args)
        replicated = await measure(
            ",".join(auth.url(u, "operator") for u in cluster.url.split(",")), 3, "R3, three nodes", args
        )
        operator = ",".join(auth.url(u, "operator") for u in cluster.url.split(","))
        gaps = [await failover(cluster, operator) for _ in range(args.failovers)]
    finally:
        cluster.stop()
        single.stop()
    summary: dict[str, object] = {
        "benchmark": "cluster",
        "floor": {s.name: s.figures() for s in floor},
        "replicated": {s.name: s.figures() for s in replicated},
        "sequential_p50_ratio_to_floor": round(replicated[0].p50_ms / floor[0].p50_ms, 2),
        "throughput_ratio_to_floor": round(replicated[1].rate / floor[1].rate, 2),
        "failover_publish_gap_s_median": round(statistics.median(gaps), 2),
        "failover_publish_gap_s_max": round(max(gaps), 2),
    }
    report(
        "JetStream publishes: three replicas on a cluster vs one on one server",
        [*floor, *replicated],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=500)
    parser.add_argument("--concurrent", type=int, default=5000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--failovers", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
