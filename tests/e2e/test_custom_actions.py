"""Custom actions registered live: over gRPC on one replica, used in a turn by another replica that
was running all along (no restart), with its result in the turn's trajectory; ``test`` without
registering, over gRPC and through ``parley actions``.

The http action calls a real HTTP server in this process on 127.0.0.1, which the runtimes may reach
because the operator allowed that address (PARLEY_CUSTOM_ACTIONS_ALLOW_HOSTS).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from http_server import LocalHttpServer, local_http_server

from parley.v1 import actions_pb2, actions_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from parley_platform.rpc import RpcClient
from parley_runtime import ids
from support import SessionEnv, Suite

PARLEY = str(Path(sys.executable).parent / "parley")
AGENT = f"customs-{secrets.token_hex(3)}"


@pytest.fixture
async def http_server() -> AsyncIterator[LocalHttpServer]:
    async with local_http_server() as server:
        yield server


def weather(server: LocalHttpServer, **extra: object) -> str:
    return json.dumps(
        {
            "id": "weather-e2e",
            "name": "CHECK_WEATHER_E2E",
            "description": "Check the current weather for a city",
            "similes": ["WEATHER_E2E"],
            "parameters": [{"name": "city", "description": "the city", "required": True}],
            "handler": {
                "type": "http",
                "method": "GET",
                "url": f"{server.base}/echo?city={{{{city}}}}",
                "headers": {"Authorization": "Bearer e2e-header-secret", "X-Key": "{{secret:WEATHER_KEY}}"},
            },
            "enabled": True,
            **extra,
        }
    )


async def parley(suite: Suite, runtime_port: int, *args: str) -> tuple[int, str, str]:
    """The CLI as a process, awaited without blocking this loop (it serves the HTTP server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env.update(
        PARLEY_NATS_URL=suite.env.nats_url,
        PARLEY_NAMESPACE=suite.namespace,
        PARLEY_OPERATOR_TOKEN=suite.env.token,
        PARLEY_RUNTIME_ADDR=f"127.0.0.1:{runtime_port}",
    )
    process = await asyncio.create_subprocess_exec(
        PARLEY, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_a_live_registration_reaches_every_replica_and_runs_in_a_turn(
    test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory, http_server: LocalHttpServer
) -> None:
    suite = Suite(test_env, tmp_path_factory.mktemp("custom"), f"c{secrets.token_hex(4)}")
    config_file = tmp_path_factory.mktemp("config") / "custom-actions.yaml"
    config_file.write_text(
        json.dumps(
            {
                "customActions": [
                    json.loads(weather(http_server, id="config-ping", name="CONFIG_PING")),
                    json.loads(weather(http_server, id="config-off", name="CONFIG_OFF", enabled=False)),
                ]
            }
        )
    )
    runtime_env = {
        "PARLEY_CUSTOM_ACTIONS_ALLOW_HOSTS": "127.0.0.1",
        "PARLEY_CUSTOM_ACTIONS_FILE": str(config_file),
        "PARLEY_TRAJECTORY_LOGGING": "true",
    }
    try:
        await suite.start(runtimes=2, **runtime_env)
        first, second = suite.runtimes
        auth = [("authorization", f"Bearer {suite.env.token}")]
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{first.grpc_port}") as one,
            grpc.aio.insecure_channel(f"127.0.0.1:{second.grpc_port}") as two,
        ):
            runtime_one, runtime_two = runtime_pb2_grpc.RuntimeStub(one), runtime_pb2_grpc.RuntimeStub(two)
            actions_one = actions_pb2_grpc.CustomActionsStub(one)
            actions_two = actions_pb2_grpc.CustomActionsStub(two)
            agent = await runtime_one.UpsertAgent(
                runtime_pb2.UpsertAgentRequest(
                    character=json.dumps(
                        {
                            "name": AGENT,
                            "bio": "checks weather",
                            "secrets": {"WEATHER_KEY": "e2e-agent-secret-value"},
                            "customActions": [
                                json.loads(weather(http_server, id="char-ping", name="CHAR_PING"))
                            ],
                        }
                    )
                ),
                metadata=auth,
                timeout=10,
            )
            # The second replica serves a turn of this agent before the action exists.
            before = await runtime_two.SendMessage(
                runtime_pb2.SendMessageRequest(agent_id=AGENT, text="hello there", timeout_seconds=20),
                metadata=auth,
                timeout=30,
            )
            assert before.replies[0].text == "You said: hello there"

            # The character's and the config file's (enabled) definitions are there from the start.
            listed = await actions_two.ListCustomActions(
                actions_pb2.ListCustomActionsRequest(agent_id=AGENT), metadata=auth, timeout=10
            )
            assert [(a.name, a.source) for a in listed.actions] == [
                ("CHAR_PING", "character"),
                ("CONFIG_PING", "config"),
            ]
            for name, field in (
                ("REPLY", "plugin basic_capabilities"),
                ("CHAR_PING", "defined by the character"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await actions_one.AddCustomAction(
                        actions_pb2.AddCustomActionRequest(
                            agent_id=AGENT, definition=weather(http_server, id="other", name=name)
                        ),
                        metadata=auth,
                        timeout=10,
                    )
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"name: {name} is" in (caught.value.details() or "")
                assert field in (caught.value.details() or "")

            # Invalid definitions are INVALID_ARGUMENT, naming the field, never echoing a value.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await actions_one.AddCustomAction(
                    actions_pb2.AddCustomActionRequest(
                        agent_id=AGENT, definition=weather(http_server, name="lower_case")
                    ),
                    metadata=auth,
                    timeout=10,
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "name: must be SCREAMING_SNAKE_CASE" in (caught.value.details() or "")
            assert "e2e-header-secret" not in (caught.value.details() or "")

            added = await actions_one.AddCustomAction(
                actions_pb2.AddCustomActionRequest(agent_id=AGENT, definition=weather(http_server)),
                metadata=auth,
                timeout=10,
            )
            assert (added.name, added.source, added.handler_type) == ("CHECK_WEATHER_E2E", "api", "http")
            assert "e2e-header-secret" not in added.definition_json
            listed = await actions_two.ListCustomActions(
                actions_pb2.ListCustomActionsRequest(agent_id=AGENT), metadata=auth, timeout=10
            )
            assert [a.id for a in listed.actions] == ["char-ping", "weather-e2e", "config-ping"]
            # The same service over NATS request/reply, for services.
            bus = await suite.connect()
            try:
                over_nats = await RpcClient(bus).call(
                    "runtime",
                    "ListCustomActions",
                    actions_pb2.ListCustomActionsRequest(agent_id=AGENT),
                    actions_pb2.ListCustomActionsResponse,
                    timeout=10,
                )
            finally:
                await bus.close()
            assert over_nats == listed

            # Only the second replica is left: it must use the action registered on the first.
            first.stop()
            sent = await runtime_two.SendMessage(
                runtime_pb2.SendMessageRequest(
                    agent_id=AGENT, text="please check the weather in Oslo", timeout_seconds=30
                ),
                metadata=auth,
                timeout=40,
            )
            [reply] = sent.replies
            assert list(reply.actions) == ["CHECK_WEATHER_E2E"]
            echoed = json.loads(reply.text)
            assert echoed["target"] == "/echo?city=Oslo%20Town%2F%26%3F"
            assert echoed["headers"]["authorization"] == "[REDACTED]"  # the output never shows it
            assert [r.target for r in http_server.requests] == ["/echo?city=Oslo%20Town%2F%26%3F"]
            # {{secret:WEATHER_KEY}} was read from the agent's (encrypted) secrets, and never shown.
            assert http_server.requests[0].headers["x-key"] == "e2e-agent-secret-value"
            assert echoed["headers"]["x-key"] == "[REDACTED]"

            turn_id = ids.message_id(uuid.UUID(agent.id), "api", sent.message_id)
            full = await runtime_two.GetTurn(
                runtime_pb2.GetTurnRequest(agent_id=AGENT, turn_id=str(turn_id)), metadata=auth, timeout=10
            )
            [record] = json.loads(full.trajectory_json)["actions"]
            assert (record["name"], record["outcome"]) == ("CHECK_WEATHER_E2E", "success")
            assert record["params"] == {"city": "Oslo Town/&?"}
            assert record["result"]["data"] == {"customAction": "weather-e2e", "handler": "http"}
            assert "e2e-header-secret" not in full.trajectory_json
            assert "e2e-agent-secret-value" not in full.trajectory_json

            # test: run without registering; the SSRF guard answers for a metadata address.
            blocked = await actions_two.TestCustomAction(
                actions_pb2.TestCustomActionRequest(
                    agent_id=AGENT,
                    definition=weather(http_server, id="meta", name="META")
                    .replace(http_server.base, "http://169.254.169.254")
                    .replace("/echo?city=", "/latest/meta-data/"),
                    params_json='{"city": "x"}',
                ),
                metadata=auth,
                timeout=30,
            )
            assert not blocked.ok
            assert "link-local" in blocked.output
            ran = await actions_two.TestCustomAction(
                actions_pb2.TestCustomActionRequest(
                    agent_id=AGENT, id="weather-e2e", params_json='{"city": "Bergen"}'
                ),
                metadata=auth,
                timeout=30,
            )
            assert ran.ok
            assert json.loads(ran.output)["target"] == "/echo?city=Bergen"
            # A value that cannot be sent (a lone surrogate) is a failed result, not an internal error.
            unsendable = await actions_two.TestCustomAction(
                actions_pb2.TestCustomActionRequest(
                    agent_id=AGENT, id="weather-e2e", params_json='{"city": "\\ud800"}'
                ),
                metadata=auth,
                timeout=30,
            )
            assert not unsendable.ok
            assert unsendable.output.startswith("the request cannot be sent")

            # The CLI: test (blocked and ok), add, list, remove.
            code, out, _ = await parley(
                suite, second.grpc_port, "actions", "test", "--agent", AGENT, "--json", "--params",
                '{"city": "x"}', weather(http_server).replace(http_server.base, "http://metadata.google.internal"),
            )  # fmt: skip
            assert code == 1
            result = json.loads(out)
            assert result["ok"] is False
            assert "metadata" in result["output"]
            definition_file = tmp_path_factory.mktemp("defs") / "shout.json"
            definition_file.write_text(weather(http_server, id="shout", name="SHOUT_E2E", similes=[]))
            code, out, err = await parley(
                suite, second.grpc_port, "actions", "add", "--agent", AGENT, str(definition_file)
            )
            assert code == 0, err
            assert "registered SHOUT_E2E" in out
            code, out, err = await parley(suite, second.grpc_port, "actions", "list", "--agent", AGENT)
            assert code == 0, err
            assert "CHECK_WEATHER_E2E" in out
            assert "SHOUT_E2E" in out
            code, out, err = await parley(
                suite, second.grpc_port, "actions", "remove", "--agent", AGENT, "shout"
            )
            assert code == 0, err
            code, out, err = await parley(
                suite, second.grpc_port, "actions", "remove", "--agent", AGENT, "shout"
            )
            assert code == 1
            assert "no custom action 'shout'" in err

            await actions_two.RemoveCustomAction(
                actions_pb2.RemoveCustomActionRequest(agent_id=AGENT, id="weather-e2e"),
                metadata=auth,
                timeout=10,
            )
            listed = await actions_two.ListCustomActions(
                actions_pb2.ListCustomActionsRequest(agent_id=AGENT), metadata=auth, timeout=10
            )
            assert [a.id for a in listed.actions] == ["char-ping", "config-ping"]
    finally:
        suite.stop()
