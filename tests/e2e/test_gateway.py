"""The model gateway as a real process (scripted provider): every RPC over gRPC and NATS, streaming,
embeddings, errors, budgets under 64 concurrent callers, the usage ledger and its CLI, the prompt
batcher's helpers across several clients, and start-up refusal on invalid batcher knobs."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml

from parley.v1 import common_pb2, model_pb2, model_pb2_grpc
from parley_clients.batcher import BatcherClient, Field
from parley_devinfra.infra import free_port
from parley_platform import frames
from parley_platform.bus import Bus
from parley_platform.errors import InvalidArgument, ParleyError, ResourceExhausted
from parley_platform.grpcserver import error_from_rpc_error
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess, create_database, drop_database, eventually
from support import ROOT, SessionEnv

RULES = {
    "rules": [
        {"match": r"(?s)## Request flaky\b", "raw": "<response><flaky__answer></flaky__answer></response>"},
        {
            "match": r"(?s)## Request numeric\b",
            "raw": "<response><numeric__count>many</numeric__count></response>",
        },
        {"match": r"please answer slowly", "text": "finally", "latency_ms": 3000},
    ]
}


# A namespace of its own: the session's namespace has the shared suite's gateway in the same
# queue group, which would answer some of these requests with other rules.
GATEWAY_NAMESPACE = f"g{secrets.token_hex(4)}"


def gateway(env: SessionEnv, logs: Path, namespace: str, **extra: str) -> ServiceProcess:
    port = free_port()
    rules = logs / "gateway-rules.yaml"
    rules.parent.mkdir(parents=True, exist_ok=True)
    rules.write_text(yaml.safe_dump(RULES))
    process_env = env.service_env(
        PARLEY_NAMESPACE=namespace,
        PARLEY_GATEWAY_GRPC_PORT=str(port),
        PARLEY_GATEWAY_METRICS_PORT=str(free_port()),
        PARLEY_SCRIPTED_RULES=str(rules),
        PARLEY_LEDGER_FLUSH_MS="50",
        **{
            # These tests drain on the gateway's own timer; test_gateway_drains.py has the scheduler's.
            "PARLEY_BATCHER_SELF_DRAIN": "true",
            "PARLEY_BATCHER_TICK_MS": "50",
            **extra,
        },
    )
    return ServiceProcess("parley_gateway", process_env, logs / f"gateway-{port}.log", port)


@pytest.fixture(scope="module")
async def gw(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServiceProcess]:
    process = gateway(
        test_env,
        tmp_path_factory.mktemp("gateway"),
        GATEWAY_NAMESPACE,
        PROMPT_BATCHER_MAX_DRAIN_INTERVAL_MS="300",
    ).start()
    try:
        await process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture
async def stub(gw: ServiceProcess) -> AsyncIterator[model_pb2_grpc.ModelGatewayStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        yield model_pb2_grpc.ModelGatewayStub(channel)


@pytest.fixture
async def nats(test_env: SessionEnv) -> AsyncIterator[Bus]:
    bus = await Bus.connect(test_env.nats_url, name="gateway-tests", namespace=GATEWAY_NAMESPACE)
    try:
        yield bus
    finally:
        await bus.close()


def auth(env: SessionEnv) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {env.token}")]


def segments(*parts: tuple[str, bool]) -> list[model_pb2.PromptSegment]:
    return [model_pb2.PromptSegment(content=c, stable=s) for c, s in parts]


async def test_generate_over_grpc_and_nats_is_the_same(
    gw: ServiceProcess, stub: model_pb2_grpc.ModelGatewayStub, nats: Bus, test_env: SessionEnv
) -> None:
    parts = segments(("# Agent\nYou are Eliza.\n", True), ("\n# Current message\nbob: hi there\n", False))
    request = model_pb2.GenerateRequest(
        agent_id="agent-e2e",
        model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
        prompt="".join(s.content for s in parts),
        segments=parts,
    )
    over_grpc = await stub.Generate(request, metadata=auth(test_env), timeout=10)
    over_nats = await RpcClient(nats).call("model", "Generate", request, model_pb2.GenerateResponse)
    for reply in (over_grpc, over_nats):
        assert reply.text.endswith("<text>You said: hi there</text></response>")
        assert (reply.provider, reply.model) == ("scripted", "scripted-v1")
        assert reply.usage.input_tokens > 0
        assert reply.usage.output_tokens > 0


async def test_generate_stream_sends_chunks_then_the_whole_response(
    stub: model_pb2_grpc.ModelGatewayStub, test_env: SessionEnv
) -> None:
    request = model_pb2.GenerateRequest(
        agent_id="agent-e2e",
        model_type=model_pb2.MODEL_TYPE_TEXT_SMALL,
        prompt="# Current message\nann: stream me",
    )
    chunks = [c async for c in stub.GenerateStream(request, metadata=auth(test_env), timeout=10)]
    assert len(chunks) > 2
    assert all(not c.done for c in chunks[:-1])
    last = chunks[-1]
    assert last.done
    assert "".join(c.text for c in chunks[:-1]) == last.response.text
    assert "You said: stream me" in last.response.text


async def test_stream_errors_carry_the_parley_code(
    stub: model_pb2_grpc.ModelGatewayStub, test_env: SessionEnv
) -> None:
    request = model_pb2.GenerateRequest(agent_id="agent-e2e", model_type=model_pb2.MODEL_TYPE_TEXT_SMALL)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.GenerateStream(request, metadata=auth(test_env), timeout=10):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_from_rpc_error(caught.value).code == "PROMPT_REQUIRED"


async def test_embed_over_both_transports(
    stub: model_pb2_grpc.ModelGatewayStub, nats: Bus, test_env: SessionEnv
) -> None:
    request = model_pb2.EmbedRequest(
        agent_id="agent-e2e", texts=["the cat sat", "the cat sat", "stocks fell"]
    )
    over_grpc = await stub.Embed(request, metadata=auth(test_env), timeout=10)
    over_nats = await RpcClient(nats).call("model", "Embed", request, model_pb2.EmbedResponse)
    for reply in (over_grpc, over_nats):
        assert reply.dimension == 384
        assert [len(e.values) for e in reply.embeddings] == [384, 384, 384]
        assert list(reply.embeddings[0].values) == list(reply.embeddings[1].values)
        assert list(reply.embeddings[0].values) != list(reply.embeddings[2].values)
        assert reply.model == "scripted-hash-384"
    assert list(over_grpc.embeddings[2].values) == list(over_nats.embeddings[2].values)


@pytest.mark.parametrize(
    ("request_", "code", "named"),
    [
        (model_pb2.GenerateRequest(prompt="x"), "UNKNOWN_MODEL_TYPE", "model_type"),
        (
            model_pb2.GenerateRequest(
                model_type=model_pb2.MODEL_TYPE_TEXT_SMALL,
                prompt="not the segments",
                segments=[model_pb2.PromptSegment(content="seg", stable=True)],
            ),
            "PROMPT_SEGMENTS_MISMATCH",
            "segments",
        ),
        (
            model_pb2.GenerateRequest(model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt="x", temperature=3),
            "INVALID_TEMPERATURE",
            "temperature",
        ),
        (
            model_pb2.GenerateRequest(model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt="x", agent_id="a.b"),
            "INVALID_AGENT_ID",
            "agent_id",
        ),
    ],
    ids=["model_type", "segments", "temperature", "agent_id"],
)
async def test_bad_requests_are_invalid_argument_naming_the_field(
    stub: model_pb2_grpc.ModelGatewayStub,
    nats: Bus,
    test_env: SessionEnv,
    request_: object,
    code: str,
    named: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(request_, metadata=auth(test_env), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    restored = error_from_rpc_error(caught.value)
    assert restored.code == code
    assert named in restored.message
    with pytest.raises(InvalidArgument) as over_nats:
        await RpcClient(nats).call("model", "Generate", request_, model_pb2.GenerateResponse)  # type: ignore[arg-type]
    assert over_nats.value.code == code


async def test_garbage_payload_over_nats_is_invalid_and_the_gateway_keeps_serving(
    gw: ServiceProcess, nats: Bus
) -> None:
    garbage = frames.request(b"\xff\xfe not protobuf", deadline=None)
    reply = await nats.nc.request(nats.subjects.rpc("model", "Generate"), garbage, timeout=5)
    status, body = frames.parse_reply(reply.data)
    assert status == frames.ERROR
    assert common_pb2.Error.FromString(body).code == "INVALID_PAYLOAD"
    ok = await RpcClient(nats).call(
        "model",
        "Generate",
        model_pb2.GenerateRequest(model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt="still there?"),
        model_pb2.GenerateResponse,
    )
    assert ok.text


async def test_caller_deadline_is_honoured(gw: ServiceProcess, nats: Bus) -> None:
    started = asyncio.get_running_loop().time()
    with pytest.raises(ParleyError) as caught:
        await RpcClient(nats).call(
            "model",
            "Generate",
            model_pb2.GenerateRequest(
                model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt="please answer slowly"
            ),
            model_pb2.GenerateResponse,
            timeout=0.5,
        )
    assert caught.value.retryable
    assert asyncio.get_running_loop().time() - started < 2.5


async def test_list_models_reports_routes_and_health(
    stub: model_pb2_grpc.ModelGatewayStub, test_env: SessionEnv
) -> None:
    reply = await stub.ListModels(model_pb2.ListModelsRequest(), metadata=auth(test_env), timeout=10)
    assert {r.model_type for r in reply.routes} == {1, 2, 3, 4}
    assert {r.provider for r in reply.routes} == {"scripted"}
    [provider] = reply.providers
    assert (provider.name, provider.circuit, provider.healthy) == ("scripted", "closed", True)
    assert (reply.embedding_provider, reply.embedding_dimension) == ("scripted", 384)


async def test_budget_holds_under_64_concurrent_callers(
    stub: model_pb2_grpc.ModelGatewayStub, test_env: SessionEnv
) -> None:
    """64 requests on 64 separate NATS connections race for a budget that admits only some of them."""
    agent = "agent-budget-race"
    request = model_pb2.GenerateRequest(
        agent_id=agent,
        model_type=model_pb2.MODEL_TYPE_TEXT_SMALL,
        prompt="# Current message\nzed: hi",
        max_tokens=100,
    )
    # Each call reserves its prompt estimate plus its 100 output tokens (107 tokens).
    budget = await stub.SetBudget(
        model_pb2.SetBudgetRequest(agent_id=agent, limit_tokens=107 * 10 + 70, window_seconds=3600),
        metadata=auth(test_env),
        timeout=10,
    )
    assert budget.limit_tokens == 1140
    buses = await asyncio.gather(
        *(Bus.connect(test_env.nats_url, name=f"racer-{i}", namespace=GATEWAY_NAMESPACE) for i in range(64))
    )
    try:
        outcomes = await asyncio.gather(
            *(RpcClient(b).call("model", "Generate", request, model_pb2.GenerateResponse) for b in buses),
            return_exceptions=True,
        )
    finally:
        await asyncio.gather(*(b.close() for b in buses))
    won = [o for o in outcomes if isinstance(o, model_pb2.GenerateResponse)]
    refused = [o for o in outcomes if isinstance(o, ResourceExhausted)]
    assert len(won) + len(refused) == 64, [
        o for o in outcomes if not isinstance(o, model_pb2.GenerateResponse)
    ]
    assert {e.code for e in refused} == {"BUDGET_EXCEEDED"}
    spent = sum(r.usage.input_tokens + r.usage.output_tokens for r in won)
    after = await stub.GetBudget(
        model_pb2.GetBudgetRequest(agent_id=agent), metadata=auth(test_env), timeout=10
    )
    assert after.reserved_tokens == 0
    assert after.spent_tokens == spent <= after.limit_tokens
    # Ten reservations fit at once; calls that finished gave back what they did not use.
    assert len(won) >= 10
    assert refused


async def test_usage_ledger_via_the_api_and_the_cli(
    gw: ServiceProcess, stub: model_pb2_grpc.ModelGatewayStub, nats: Bus, test_env: SessionEnv
) -> None:
    agent = str(uuid.uuid4())
    rpc = RpcClient(nats)
    for text in ("one", "two", "three"):
        await rpc.call(
            "model",
            "Generate",
            model_pb2.GenerateRequest(
                agent_id=agent, model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt=text
            ),
            model_pb2.GenerateResponse,
        )
    await rpc.call(
        "model", "Embed", model_pb2.EmbedRequest(agent_id=agent, texts=["a", "b"]), model_pb2.EmbedResponse
    )

    async def rows() -> list[model_pb2.UsageRow]:
        reply = await stub.GetUsage(
            model_pb2.GetUsageRequest(agent_id=agent), metadata=auth(test_env), timeout=10
        )
        return list(reply.rows)

    found = await eventually(rows, what="ledger rows")
    by_kind = {r.kind: r for r in found}
    assert by_kind["generate"].requests == 3
    assert by_kind["generate"].model_type == model_pb2.MODEL_TYPE_TEXT_SMALL
    assert by_kind["embed"].requests == 1
    assert by_kind["embed"].usage.input_tokens == 2

    env = {
        **os.environ,
        "PARLEY_OPERATOR_TOKEN": test_env.token,
        "PARLEY_MODEL_GATEWAY_ADDR": f"127.0.0.1:{gw.grpc_port}",
    }
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "parley_cli.main", "models", "usage", "--agent", agent],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if line.startswith(agent)]
    assert len(lines) == 2
    assert any(" generate " in line and " 3 " in line for line in lines)
    listed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "parley_cli.main", "models", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert listed.returncode == 0, listed.stderr
    assert "TEXT_LARGE" in listed.stdout
    assert "scripted-hash-384 (384 dims)" in listed.stdout


async def test_batcher_helpers_through_the_gateway(
    gw: ServiceProcess, nats: Bus, test_env: SessionEnv
) -> None:
    client = BatcherClient(nats, "agent-helpers", timeout=10)
    try:
        # ask_now: registered and drained at once; the scripted model fills every field.
        now = await client.ask_now(
            "mood",
            "How does the user feel?",
            ["feeling", Field("reason", "why")],
            fallback={"feeling": "unknown"},
        )
        assert now == {"feeling": "scripted", "reason": "scripted"}
        # A bad answer is retried, then the fallback is used, and ask_now still answers.
        flaky = await client.ask_now(
            "flaky", "Answer me", ["answer"], fallback={"answer": "fallback"}, max_retries=2
        )
        assert flaky == {"answer": "fallback"}
        # ask_once: answered by the gateway's own drain timer.
        once = await client.ask_once("startup", "What is your name?", ["name"])
        assert once == {"name": "scripted"}
        assert await client.ask_once("startup", "What is your name?", ["name"]) is None
        # on_drain: every drain delivers; the future resolves with the first.
        seen: list[model_pb2.SectionResult] = []
        first = await client.on_drain("reflect", "Reflect", ["insight"], on_result=seen.append)
        assert first is not None
        result = await asyncio.wait_for(first, 10)
        assert dict(result.fields) == {"insight": "scripted"}
        await eventually(lambda: _true(len(seen) >= 2), what="a second per-drain delivery")
        await client.drain("default")  # delivered in the reply and published: still one call per drain
        assert len({r.drain_seq for r in seen}) == len(seen)
        # think: recurring, at most once per min_cycle_ms.
        thoughts: list[model_pb2.SectionResult] = []
        assert await client.think("muse", "Think", ["idea"], on_result=thoughts.append, min_cycle_ms=200)
        await eventually(lambda: _true(len(thoughts) >= 2), what="two recurring thoughts")
        assert all(t.affinity == "autonomy" for t in thoughts)
    finally:
        disposed = await client.dispose()
    assert disposed >= 2  # the per-drain and the recurring section were still registered
    status = await RpcClient(nats).call(
        "model",
        "BatcherStatus",
        model_pb2.BatcherStatusRequest(affinity="autonomy"),
        model_pb2.BatcherStatusResponse,
    )
    assert all(a.sections == 0 for a in status.affinities)


async def _true(value: bool) -> bool:
    return value


async def test_sections_from_several_replicas_share_one_call(test_env: SessionEnv, tmp_path: Path) -> None:
    """Two runtime replicas (separate NATS connections) register sections; one drain packs them
    together. A gateway and a database of its own, whose timer does not tick during the test: a
    self-draining gateway drains every pending section of its database at its next tick (the
    module's, every 50 ms), which could take the first section before the second is registered,
    and the drain asked for here would find nothing."""
    namespace = f"g{secrets.token_hex(4)}"
    database = f"gw_{secrets.token_hex(4)}"
    url = create_database(test_env.server_database_url, database)
    process = gateway(
        test_env, tmp_path, namespace, PARLEY_BATCHER_TICK_MS="60000", PARLEY_DATABASE_URL=url
    ).start()
    await process.wait_ready()
    buses = [await Bus.connect(test_env.nats_url, name=f"replica-{i}", namespace=namespace) for i in range(2)]
    clients = [BatcherClient(bus, "agent-shared", timeout=10) for bus in buses]
    try:
        futures = []
        for index, client in enumerate(clients):
            section = client.section(
                f"eval{index}", f"Evaluate message {index}", ["verdict"], affinity="room:r1"
            )
            futures.append(await client._register(section, None))
        drained = await clients[0].drain("room:r1")
        assert drained.sections == 2
        assert drained.calls == 1
        results = await asyncio.gather(*(asyncio.wait_for(f, 10) for f in futures if f is not None))
        assert [dict(r.fields) for r in results] == [{"verdict": "scripted"}, {"verdict": "scripted"}]
        assert {r.drain_seq for r in results} == {drained.drain_seq}
    finally:
        for client in clients:
            await client.dispose()
        for bus in buses:
            await bus.close()
        process.stop()
        drop_database(test_env.server_database_url, database)


@pytest.mark.parametrize(
    ("key", "value"),
    [("PROMPT_BATCHER_BATCH_SIZE", "2.5"), ("PROMPT_BATCHER_PACKING_DENSITY", "NaN")],
)
async def test_invalid_batcher_knob_refuses_to_start(
    test_env: SessionEnv, tmp_path: Path, key: str, value: str
) -> None:
    process = gateway(test_env, tmp_path, GATEWAY_NAMESPACE, **{key: value}).start()
    try:
        assert process.process is not None
        code = await asyncio.to_thread(process.process.wait, 30)
    finally:
        process.stop()
    assert code == 2
    log = process.log()
    assert "PROMPT_BATCHER_CONFIG_INVALID" in log
    assert key in log


async def test_metrics_of_the_spec_are_served(gw: ServiceProcess, nats: Bus) -> None:
    await RpcClient(nats).call(
        "model",
        "Generate",
        model_pb2.GenerateRequest(model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt="count me"),
        model_pb2.GenerateResponse,
    )
    port = gw.env["PARLEY_GATEWAY_METRICS_PORT"]

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()

    client = BatcherClient(nats, "agent-metrics", timeout=10)
    try:
        assert await client.ask_once("gauge", "Anything?", ["x"], affinity="room:metrics") == {
            "x": "scripted"
        }
    finally:
        await client.dispose()

    async def scraped() -> str:
        text = await asyncio.to_thread(scrape)
        return text if 'parley_batcher_sections{affinity="room"}' in text else ""

    text = await eventually(scraped, what="the batcher gauge")
    for name in (
        'parley_model_requests_total{model_type="TEXT_SMALL",outcome="ok",provider="scripted"}',
        'parley_model_request_duration_seconds_bucket{le="0.005",model_type="TEXT_SMALL",provider="scripted"}',
        'parley_model_tokens_total{kind="cached",provider="scripted"}',
        'parley_model_inflight{provider="scripted"}',
        "parley_model_budget_rejections_total",
        "parley_batcher_sections{",
        "parley_batcher_calls_total",
        "parley_batcher_sections_per_call_bucket",
    ):
        assert name in text, name
