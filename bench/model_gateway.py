"""Model gateway: its overhead against a raw NATS request/reply, batcher packing, local model speed.

1. Overhead: ``Generate`` over NATS to a real gateway process with the scripted provider at zero
   latency (validation, routing, budget check, limiter, breaker, ledger, metrics), sequential and
   64 in flight, against a raw NATS request/reply echo of the same size measured in the same run,
   the three taking turns in chunks.
2. Packing: realistic mixes of batcher sections (evaluators per room, start-up questions, autonomy)
   registered and drained through the gateway; model calls per section.
3. The local model: output tokens/s of SmolLM2-135M through the gateway (grammar-constrained,
   ``<response>`` contract) against raw llama.cpp on the same prompts without a grammar.

Usage: python bench/model_gateway.py [--sequential 2000] [--concurrent 8000] [--in-flight 64]
       [--local-prompts 8] [--no-local]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

from _common import ROOT, BenchEnv, Series, bench_env, report, service_nats

from parley.v1 import model_pb2
from parley_clients.batcher import BatcherClient
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess

Op = Callable[[int], Awaitable[object]]

# The RPC envelope alone: the platform's RpcServer in a process of its own, answering Generate with
# a canned response and doing nothing else. It separates what the RPC framework costs (the
# deadline and status headers, a task per request, decoding and encoding) from what the gateway's
# own handling costs.
ENVELOPE = r"""
import asyncio, os, uvloop
from parley.v1 import model_pb2
from parley_platform.bus import Bus
from parley_platform.rpc import RpcServer

async def main():
    url, namespace = os.environ["BENCH_NATS_URL"], os.environ["BENCH_NS"]
    bus = await Bus.connect(url, name="bench-envelope", namespace=namespace)
    canned = model_pb2.GenerateResponse.FromString(bytes.fromhex(os.environ["BENCH_RESPONSE"]))

    async def generate(request):
        return canned

    server = RpcServer(bus, "benchenvelope")
    server.register("Generate", model_pb2.GenerateRequest, generate)
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()

uvloop.run(main())
"""
CHUNKS = 8  # turns each series takes, alternating with the others
PROMPT = "# Agent\nYou are Eliza.\n\n# Current message\nbob: how are you today?\n"


async def timed(name: str, n: int, in_flight: int, op: Op) -> Series:
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return Series(name, latencies, time.perf_counter() - started)


def start_gateway(env: BenchEnv, namespace: str, **extra: str) -> ServiceProcess:
    port = free_port()
    process_env = {
        **service_nats(env),
        "PARLEY_DATABASE_URL": env.database_url,
        "PARLEY_NAMESPACE": namespace,
        "PARLEY_OPERATOR_TOKEN": secrets.token_hex(16),
        "PARLEY_LOG_LEVEL": "WARNING",
        "PARLEY_ENVIRONMENT": "test",
        "PARLEY_GATEWAY_GRPC_PORT": str(port),
        "PARLEY_GATEWAY_METRICS_PORT": str(free_port()),
        "PARLEY_BATCHER_SELF_DRAIN": "false",
        **extra,
    }
    return ServiceProcess("parley_gateway", process_env, env.logs / f"gateway-{port}.log", port).start()


def start_envelope(
    env: BenchEnv, namespace: str, response: model_pb2.GenerateResponse
) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", ENVELOPE],
        env={
            **os.environ,
            "BENCH_NATS_URL": env.nats_url,
            "BENCH_NS": namespace,
            "BENCH_RESPONSE": response.SerializeToString().hex(),
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise RuntimeError("the RPC envelope process did not start")
    return process


async def overhead(bus: Bus, env: BenchEnv, args: argparse.Namespace) -> dict[str, Series]:
    rpc = RpcClient(bus)
    request = model_pb2.GenerateRequest(
        agent_id="bench-agent", model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt=PROMPT
    )
    payload = request.SerializeToString()
    response = await rpc.call("model", "Generate", request, model_pb2.GenerateResponse)
    reply_size = len(response.SerializeToString())
    echo_subject = f"{bus.subjects.ns}.bench.echo"
    canned = b"x" * reply_size

    async def echo(msg: object) -> None:
        await msg.respond(canned)  # type: ignore[attr-defined]

    await bus.nc.subscribe(echo_subject, cb=echo)

    async def generate(_i: int) -> object:
        return await rpc.call("model", "Generate", request, model_pb2.GenerateResponse)

    async def raw(_i: int) -> object:
        return await bus.nc.request(echo_subject, payload, timeout=5)

    async def envelope(_i: int) -> object:
        return await rpc.call("benchenvelope", "Generate", request, model_pb2.GenerateResponse)

    ops = {
        "gateway Generate": generate,
        "RPC envelope alone": envelope,
        "raw NATS request/reply": raw,
    }
    results: dict[str, Series] = {}
    envelope_process = start_envelope(env, bus.subjects.ns, response)
    try:
        for op in ops.values():
            await timed("warm-up", 300, 8, op)
        # The three take turns, a chunk each, so a slow moment of the machine (a shared VM's
        # throughput swings by a third between runs of one configuration) falls on all three alike.
        for key, n, in_flight, label in (
            ("1", args.sequential, 1, "sequential"),
            ("n", args.concurrent, args.in_flight, f"{args.in_flight} in flight"),
        ):
            chunks = max(1, min(CHUNKS, n // max(1, in_flight)))
            parts: dict[str, list[Series]] = {name: [] for name in ops}
            for _ in range(chunks):
                for name, op in ops.items():
                    parts[name].append(await timed(name, n // chunks, in_flight, op))
            for name in ops:
                results[f"{name}:{key}"] = Series.merged(f"{name}, {label}", parts[name])
    finally:
        envelope_process.kill()
        envelope_process.wait()
    return results


# Realistic section mixes: (name, affinity, sections as (fields, prompt words, priority), agents).
MIXES = [
    ("evaluators per room", "room:r1", [(2, 60, "normal"), (1, 40, "normal"), (3, 90, "normal")] * 4, 2),
    ("start-up questions", "init", [(1, 20, "normal")] * 12, 1),
    ("mixed priorities", "default", [(1, 30, "immediate"), (2, 50, "normal"), (1, 200, "background")] * 5, 2),
    ("large evaluator prompts", "room:r2", [(2, 2500, "normal")] * 10, 1),
]
PRIORITIES = {
    "immediate": model_pb2.SECTION_PRIORITY_IMMEDIATE,
    "normal": model_pb2.SECTION_PRIORITY_NORMAL,
    "background": model_pb2.SECTION_PRIORITY_BACKGROUND,
}


async def packing(bus: Bus) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    for mix, affinity, shapes, agents in MIXES:
        clients = [BatcherClient(bus, f"bench-{mix.split()[0]}-{a}", timeout=30) for a in range(agents)]
        sections = 0
        for client in clients:
            for index, (fields, words, priority) in enumerate(shapes):
                prompt = " ".join(["word"] * words)
                section = client.section(
                    f"s{index}",
                    f"Evaluate this: {prompt}",
                    [f"field{f}" for f in range(fields)],
                    affinity=affinity,
                    priority=PRIORITIES[priority],
                )
                await client.add_section(section)
                sections += 1
        started = time.perf_counter()
        drained = await clients[0].drain(affinity)
        elapsed = time.perf_counter() - started
        for client in clients:
            await client.dispose()
        figures[mix] = {
            "sections": drained.sections,
            "calls": drained.calls,
            "calls_per_section": round(drained.calls / max(1, drained.sections), 3),
            "drain_ms": round(elapsed * 1000, 1),
        }
        assert drained.sections == sections, (mix, drained.sections, sections)
    return figures


LOCAL_MESSAGES = [
    "hello!",
    "what is your name?",
    "tell me a joke",
    "how are you?",
    "what is 2 + 2?",
    "good night",
]


async def local_speed(env: BenchEnv, prompts: int) -> dict[str, float]:
    namespace = f"l{secrets.token_hex(4)}"
    gateway = start_gateway(
        env, namespace, PARLEY_MODEL_PROVIDER="local", PARLEY_EMBEDDING_PROVIDER="scripted"
    )
    bus = await Bus.connect(env.nats_url, name="bench-local", namespace=namespace)
    try:
        await gateway.wait_ready(60)
        rpc = RpcClient(bus)
        stable = (
            "# Agent\nYou are Eliza, a kind assistant.\n\n# Output format\n"
            "<response><thought>a thought</thought><actions>REPLY</actions>"
            "<text>what you say</text></response>\n"
        )
        tokens = 0
        seconds = 0.0
        cached = 0
        inputs = 0
        for i in range(prompts):
            text = f"\n# Current message\nalice: {LOCAL_MESSAGES[i % len(LOCAL_MESSAGES)]}\n"
            segments = [
                model_pb2.PromptSegment(content=stable, stable=True),
                model_pb2.PromptSegment(content=text, stable=False),
            ]
            reply = await rpc.call(
                "model",
                "Generate",
                model_pb2.GenerateRequest(
                    model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
                    prompt=stable + text,
                    segments=segments,
                    max_tokens=96,
                    temperature=0.7,
                ),
                model_pb2.GenerateResponse,
                timeout=300,
            )
            tokens += reply.usage.output_tokens
            seconds += reply.latency_seconds
            cached += reply.usage.cached_input_tokens
            inputs += reply.usage.input_tokens
    finally:
        await bus.close()
        gateway.stop()

    raw_tokens, raw_seconds = await asyncio.to_thread(_raw_llama, prompts)
    gateway_rate = tokens / seconds if seconds else float("nan")
    raw_rate = raw_tokens / raw_seconds if raw_seconds else float("nan")
    return {
        "gateway_tokens_per_s": round(gateway_rate, 1),
        "raw_llama_tokens_per_s": round(raw_rate, 1),
        "ratio_to_raw": round(gateway_rate / raw_rate, 2),
        "cached_input_share": round(cached / max(1, inputs), 3),
        "prompts": prompts,
    }


def _raw_llama(prompts: int) -> tuple[int, float]:
    """The floor: llama.cpp itself, one thread, no grammar, the same kind of prompt."""
    from llama_cpp import Llama

    from parley_gateway.local import smollm_path

    llm = Llama(model_path=str(smollm_path()), n_ctx=2048, n_threads=1, n_threads_batch=1, verbose=False)
    tokens = 0
    seconds = 0.0
    for i in range(prompts):
        prompt = (
            "<|im_start|>system\nYou are Eliza, a kind assistant.<|im_end|>\n<|im_start|>user\n"
            f"{LOCAL_MESSAGES[i % len(LOCAL_MESSAGES)]}<|im_end|>\n<|im_start|>assistant\n"
        )
        started = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=64, temperature=0.7)
        seconds += time.perf_counter() - started
        tokens += out["usage"]["completion_tokens"]  # type: ignore[index]
    llm.close()
    return tokens, seconds


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        namespace = f"g{secrets.token_hex(4)}"
        gateway = start_gateway(env, namespace, PARLEY_MODEL_PROVIDER="scripted")
        bus = await Bus.connect(env.nats_url, name="bench", namespace=namespace)
        try:
            await gateway.wait_ready()
            series = await overhead(bus, env, args)
            packed = await packing(bus)
        finally:
            await bus.close()
            gateway.stop()
        local = await local_speed(env, args.local_prompts) if not args.no_local else {}

    def ratio(key: str, attr: str, of: str = "gateway Generate", to: str = "raw NATS request/reply") -> float:
        return round(getattr(series[f"{of}:{key}"], attr) / getattr(series[f"{to}:{key}"], attr), 2)

    summary: dict[str, object] = {
        "benchmark": "model_gateway",
        "series": {key: s.figures() for key, s in series.items()},
        "overhead_ratio_p50_sequential": ratio("1", "p50_ms"),
        "overhead_ratio_p99_sequential": ratio("1", "p99_ms"),
        "overhead_ratio_p99_concurrent": ratio("n", "p99_ms"),
        "throughput_ratio_sequential": round(
            series["gateway Generate:1"].rate / series["raw NATS request/reply:1"].rate, 2
        ),
        "throughput_ratio_concurrent": round(
            series["gateway Generate:n"].rate / series["raw NATS request/reply:n"].rate, 2
        ),
        # Where the gateway's overhead lies: the RPC envelope alone against the raw round trip, and
        # the gateway against the envelope (its own handling).
        "envelope_ratio_p50_sequential": ratio("1", "p50_ms", of="RPC envelope alone"),
        "envelope_throughput_ratio_concurrent": ratio("n", "rate", of="RPC envelope alone"),
        "gateway_to_envelope_p50_sequential": ratio("1", "p50_ms", to="RPC envelope alone"),
        "gateway_to_envelope_throughput_concurrent": ratio("n", "rate", to="RPC envelope alone"),
        "packing": packed,
        "local_model": local,
        "in_flight": args.in_flight,
    }
    report(
        "Model gateway (scripted provider, zero latency) against a raw NATS request/reply",
        list(series.values()),
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=2000)
    parser.add_argument("--concurrent", type=int, default=8000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--local-prompts", type=int, default=8)
    parser.add_argument("--no-local", action="store_true")
    assert ROOT.is_dir()
    asyncio.run(main(parser.parse_args()))
