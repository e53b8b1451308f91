"""MCP servers' tools as an agent's actions, with real processes: the runtime (and gateway, authz)
as processes, the official reference server ``mcp-server-time`` over stdio (a child of the
runtime), and a streamable HTTP server written here with the SDK's ``MCPServer`` (FastMCP).

- a scripted plan calls ``TIME_GET_CURRENT_TIME``: the reply is the tool's answer, the trajectory
  shows the call; the server killed mid-session is started again and the next call works;
- the HTTP server's read-only tool runs; its destructive tool waits for an approval and runs once
  after it; a tool added while running is picked up (``notifications/tools/list_changed``);
- the SSRF guard refuses a server on a private network; stdio is refused where it is off;
- ``parley mcp add|list|test|remove`` as a process.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

from parley.v1 import authz_pb2, authz_pb2_grpc, mcp_pb2, mcp_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from parley_devinfra.infra import free_port
from parley_platform.testing import eventually
from parley_runtime import ids
from support import SessionEnv, Suite

BIN = Path(sys.executable).parent
AGENT = f"timely-{secrets.token_hex(3)}"


class Notes:
    """The streamable HTTP MCP server of the tests, in this process, with what it was asked."""

    def __init__(self) -> None:
        self.erased: list[str] = []
        self.lookups: list[str] = []
        self.authorizations: list[str] = []
        self.server = MCPServer("notes")
        read_only = ToolAnnotations(read_only_hint=True)

        @self.server.tool(description="Look up the notes on a topic.", annotations=read_only)
        def lookup(topic: str, ctx: Context) -> str:
            self.lookups.append(topic)
            self.authorizations.append((ctx.headers or {}).get("authorization", ""))
            return f"notes on {topic}: MCP is how tools are shared"

        @self.server.tool(
            description="Erase every note.",
            annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True),
        )
        def erase_all(reason: str) -> str:
            self.erased.append(reason)
            return f"erased every note ({reason})"

        @self.server.tool(description="Unlock more note tools.", annotations=read_only)
        async def unlock(ctx: Context) -> str:
            def count() -> str:
                return "there are 3 notes"

            self.server.add_tool(count, name="count", annotations=read_only)
            await ctx.request_context.session.send_tool_list_changed()
            return "unlocked"

    async def serve(self) -> AsyncIterator[str]:
        port = free_port()
        config = uvicorn.Config(
            self.server.streamable_http_app(), host="127.0.0.1", port=port, log_config=None, lifespan="on"
        )
        http = uvicorn.Server(config)
        task = asyncio.create_task(http.serve())
        await eventually(lambda: asyncio.sleep(0, http.started), timeout=10, what="the MCP server")
        try:
            yield f"http://127.0.0.1:{port}/mcp"
        finally:
            http.should_exit = True
            await asyncio.wait_for(task, 10)


async def parley(suite: Suite, port: int, *args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env.update(
        PARLEY_NATS_URL=suite.env.nats_url,
        PARLEY_NAMESPACE=suite.namespace,
        PARLEY_OPERATOR_TOKEN=suite.env.token,
        PARLEY_RUNTIME_ADDR=f"127.0.0.1:{port}",
    )
    process = await asyncio.create_subprocess_exec(
        str(BIN / "parley"), *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 90)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def children(pid: int, needle: str) -> list[int]:
    """Processes under ``pid`` whose command line holds ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if needle in cmdline and (ppid == pid or pid in _ancestors(ppid)):
            found.append(int(entry.name))
    return found


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            break
    return seen


@pytest.fixture(scope="module")
async def notes() -> AsyncIterator[tuple[Notes, str]]:
    server = Notes()
    async for url in server.serve():
        yield server, url


async def test_mcp_servers_tools_are_actions(
    test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory, notes: tuple[Notes, str]
) -> None:
    server, url = notes
    suite = Suite(test_env, tmp_path_factory.mktemp("mcp"), f"m{secrets.token_hex(4)}")
    runtime_env = {
        "PARLEY_MCP_STDIO": "true",
        "PARLEY_MCP_ALLOW_HOSTS": "127.0.0.1",
        "PARLEY_TRAJECTORY_LOGGING": "true",
    }
    auth = [("authorization", f"Bearer {suite.env.token}")]
    try:
        await suite.start(runtimes=1, **runtime_env)
        await suite.add_service("parley_authz", "AUTHZ")
        runtime = suite.runtime
        async with grpc.aio.insecure_channel(f"127.0.0.1:{runtime.grpc_port}") as channel:
            agents = runtime_pb2_grpc.RuntimeStub(channel)
            mcp = mcp_pb2_grpc.McpStub(channel)
            agent = await agents.UpsertAgent(
                runtime_pb2.UpsertAgentRequest(
                    character=json.dumps(
                        {
                            "name": AGENT,
                            "bio": "knows the time",
                            "secrets": {"NOTES_TOKEN": "notes-secret-value"},
                            "mcpServers": {
                                "time": {
                                    "command": str(BIN / "mcp-server-time"),
                                    "args": ["--local-timezone", "UTC"],
                                },
                                "notes": {
                                    "url": url,
                                    "headers": {"Authorization": "Bearer {{secret:NOTES_TOKEN}}"},
                                },
                            },
                        }
                    )
                ),
                metadata=auth,
                timeout=10,
            )

            async def ask(text: str, channel: str = "") -> runtime_pb2.SendMessageResponse:
                return await agents.SendMessage(
                    runtime_pb2.SendMessageRequest(
                        agent_id=AGENT, text=text, timeout_seconds=40, channel_id=channel
                    ),
                    metadata=auth,
                    timeout=60,
                )

            # The reference server over stdio: the plan's call, its answer as the reply.
            sent = await ask("what time is it in Oslo?")
            [reply] = sent.replies
            assert list(reply.actions) == ["TIME_GET_CURRENT_TIME"]
            answer = json.loads(reply.text)
            assert answer["timezone"] == "Europe/Oslo"
            assert "datetime" in answer
            turn_id = ids.message_id(uuid.UUID(agent.id), "api", sent.message_id)
            turn = await agents.GetTurn(
                runtime_pb2.GetTurnRequest(agent_id=AGENT, turn_id=str(turn_id)), metadata=auth, timeout=10
            )
            [record] = json.loads(turn.trajectory_json)["actions"]
            assert (record["name"], record["outcome"]) == ("TIME_GET_CURRENT_TIME", "success")
            assert record["params"] == {"timezone": "Europe/Oslo"}
            assert record["result"]["data"]["mcpServer"] == "time"

            # Killed mid-session: the session is opened again (a new process), the next call works.
            assert runtime.process is not None
            [pid] = children(runtime.process.pid, "mcp-server-time")
            os.kill(pid, signal.SIGKILL)

            async def restarted() -> bool:
                listed = await mcp.ListMcpServers(
                    mcp_pb2.ListMcpServersRequest(agent_id=AGENT), metadata=auth, timeout=10
                )
                time_server = next(s for s in listed.servers if s.name == "time")
                return time_server.sessions >= 2 and time_server.state == "connected"

            await eventually(restarted, timeout=30, what="the time server's second session")
            assert children(runtime.process.pid, "mcp-server-time") not in ([], [pid])
            again = await ask("what time is it in Oslo, again?")
            assert json.loads(again.replies[0].text)["timezone"] == "Europe/Oslo"

            # Racing turns (in rooms of their own) share the replica's one session: every call
            # answered, no new session, one server process.
            raced = await asyncio.gather(
                *(ask(f"what time is it in Oslo, race {i}?", channel=f"race-{i}") for i in range(8))
            )
            assert all(json.loads(r.replies[0].text)["timezone"] == "Europe/Oslo" for r in raced)
            listed = await mcp.ListMcpServers(
                mcp_pb2.ListMcpServersRequest(agent_id=AGENT), metadata=auth, timeout=10
            )
            assert next(s for s in listed.servers if s.name == "time").sessions == 2
            assert len(children(runtime.process.pid, "mcp-server-time")) == 1

            # Streamable HTTP: a read-only tool runs at once, with the agent's secret as its header.
            looked = await ask("please look up mcp")
            assert "MCP is how tools are shared" in looked.replies[0].text
            assert server.lookups == ["mcp"]
            assert server.authorizations == ["Bearer notes-secret-value"]

            # A destructive tool waits for a person: asked, not run; approved, run once.
            erase = await ask("please erase the notes")
            texts = [r.text for r in erase.replies]
            assert any("confirmation" in t and "NOTES_ERASE_ALL" in t for t in texts), texts
            assert server.erased == []
            authz = await suite_authz(suite)
            call_id = f"{ids.message_id(uuid.UUID(agent.id), 'api', erase.message_id)}:0"
            async with grpc.aio.insecure_channel(authz) as authz_channel:
                decided = await authz_pb2_grpc.AuthzStub(authz_channel).Decide(
                    authz_pb2.DecideRequest(
                        agent_id=agent.id,
                        tool_call_id=call_id,
                        decision=authz_pb2.TOOL_DECISION_APPROVE,
                        decided_by="operator",
                    ),
                    metadata=auth,
                    timeout=10,
                )
            assert decided.result == authz_pb2.DECIDE_RESULT_CLAIMED
            await eventually(
                lambda: asyncio.sleep(0, server.erased), timeout=30, what="the erase after approval"
            )
            await asyncio.sleep(1)
            assert server.erased == ["spring cleaning"]

            # A tool added while running is announced; the next turn has it.
            await ask("please unlock more notes")
            counted = await ask("please count the notes")
            assert counted.replies[0].text == "there are 3 notes"

            # The SSRF guard: a server on a private network is refused, saying why.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await mcp.AddMcpServer(
                    mcp_pb2.AddMcpServerRequest(
                        agent_id=AGENT, name="inside", definition_json='{"url": "http://10.1.2.3/mcp"}'
                    ),
                    metadata=auth,
                    timeout=10,
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "private" in (caught.value.details() or "")
            tried = await mcp.TestMcpServer(
                mcp_pb2.TestMcpServerRequest(
                    agent_id=AGENT, name="inside", definition_json='{"url": "http://192.168.7.7:8000/mcp"}'
                ),
                metadata=auth,
                timeout=30,
            )
            assert not tried.ok
            assert "private" in tried.error

            # The CLI: list, test, add, remove.
            port = runtime.grpc_port
            code, out, err = await parley(suite, port, "mcp", "list", AGENT, "--json")
            assert code == 0, err
            listed = {s["name"]: s for s in json.loads(out)}
            assert listed["notes"]["state"] == "connected"
            assert "notes-secret-value" not in out
            assert {t["action"] for t in listed["notes"]["tools"]} >= {"NOTES_LOOKUP", "NOTES_ERASE_ALL"}
            erase_tool = next(t for t in listed["notes"]["tools"] if t["action"] == "NOTES_ERASE_ALL")
            assert erase_tool["needs_confirmation"] is True
            code, out, err = await parley(suite, port, "mcp", "test", AGENT, "time")
            assert code == 0, out + err
            assert "TIME_CONVERT_TIME" in out
            code, out, err = await parley(
                suite,
                port,
                "mcp",
                "add",
                AGENT,
                "clock",
                "--",
                str(BIN / "mcp-server-time"),
                "--local-timezone",
                "UTC",
            )
            assert code == 0, err
            if "CLOCK_GET_CURRENT_TIME" not in out:
                # The add waits a bounded time for the first session (15 s, 3 attempts). A server
                # that is not up by then is added anyway, said so (with its last error), and kept
                # trying; its tools arrive with its session.
                assert "actions: none yet" in out, out + err
                assert "(stdio, starting)" in out or "its last session ended:" in err, out + err

                async def clock_connected() -> bool:
                    listed = await mcp.ListMcpServers(
                        mcp_pb2.ListMcpServersRequest(agent_id=AGENT), metadata=auth, timeout=10
                    )
                    clock = next(s for s in listed.servers if s.name == "clock")
                    return "CLOCK_GET_CURRENT_TIME" in {t.action for t in clock.tools}

                await eventually(clock_connected, timeout=60, what=f"the clock server's tools ({out}{err})")
            code, out, err = await parley(suite, port, "mcp", "remove", AGENT, "clock")
            assert code == 0, err
            # A server that cannot start: added, and the CLI says why it has no actions.
            code, out, err = await parley(suite, port, "mcp", "add", AGENT, "broken", "--", "/bin/false")
            assert code == 0, err
            assert "added broken (stdio, restarting); actions: none yet" in out
            assert "its last session ended:" in err, err
            code, out, err = await parley(suite, port, "mcp", "remove", AGENT, "broken")
            assert code == 0, err
            code, out, err = await parley(suite, port, "mcp", "remove", AGENT, "clock")
            assert code == 1
            assert "no MCP server 'clock'" in err
    finally:
        suite.stop()


async def suite_authz(suite: Suite) -> str:
    [authz] = [p for p in suite.others if p.module == "parley_authz"]
    return f"127.0.0.1:{authz.grpc_port}"


async def test_stdio_servers_are_off_unless_enabled(
    test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    suite = Suite(test_env, tmp_path_factory.mktemp("mcp-off"), f"m{secrets.token_hex(4)}")
    auth = [("authorization", f"Bearer {suite.env.token}")]
    try:
        await suite.start(runtimes=1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{suite.runtime.grpc_port}") as channel:
            mcp = mcp_pb2_grpc.McpStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await mcp.AddMcpServer(
                    mcp_pb2.AddMcpServerRequest(
                        agent_id="default",
                        name="time",
                        definition_json=json.dumps({"command": str(BIN / "mcp-server-time")}),
                    ),
                    metadata=auth,
                    timeout=10,
                )
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "PARLEY_MCP_STDIO" in (caught.value.details() or "") or "stdio" in (
                caught.value.details() or ""
            )
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await mcp.AddMcpServer(
                    mcp_pb2.AddMcpServerRequest(
                        agent_id="default",
                        name="both",
                        definition_json='{"command": "x", "url": "http://a.b/"}',
                    ),
                    metadata=auth,
                    timeout=10,
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "either command" in (bad.value.details() or "")
    finally:
        suite.stop()
