"""elizaOS character files as they are (0.x, 1.x and the current shape; tests/characters/eliza_*.json)
load through the API and `parley agents add`, answer a message, and their examples and templates
are in the prompts the turn recorded. Their knowledge becomes the agent's documents, once."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import grpc
import psycopg
from test_cli import cli_env, run

from parley.v1 import documents_pb2, documents_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from parley_runtime import ids
from support import ROOT, Suite, inbound, publish_inbound, replies_to

CHARACTERS = ROOT / "tests" / "characters"
FILES = {"Trinity": "eliza_v0.json", "Orion": "eliza_v1.json", "Vega": "eliza_current.json"}
SECRETS = ("v0-secret-not-shown", "v1-secret-not-shown")


async def _turn(runtime: Any, auth: Any, agent: runtime_pb2.Agent, reply: Any) -> dict[str, Any]:
    turn_id = ids.message_id(uuid.UUID(agent.id), "api", reply.message_id)
    found = await runtime.GetTurn(
        runtime_pb2.GetTurnRequest(agent_id=agent.id, turn_id=str(turn_id)), metadata=auth, timeout=10
    )
    trajectory: dict[str, Any] = json.loads(found.trajectory_json)
    return trajectory


def _planner_prompt(trajectory: dict[str, Any]) -> tuple[str, str]:
    """The stable part of the planner prompt, and all of it."""
    segments = trajectory["segments"]
    return (
        "".join(s["content"] for s in segments if s["stable"]),
        "".join(s["content"] for s in segments),
    )


async def _documents(channel: grpc.aio.Channel, auth: Any, agent: str, want: int) -> list[str]:
    stub = documents_pb2_grpc.DocumentsStub(channel)
    deadline = time.monotonic() + 60
    while True:
        listed = await stub.ListDocuments(
            documents_pb2.ListDocumentsRequest(
                agent_id=agent, requester=documents_pb2.Requester(operator=True)
            ),
            metadata=auth,
            timeout=10,
        )
        if len(listed.documents) >= want or time.monotonic() > deadline:
            return sorted(d.title for d in listed.documents)
        await asyncio.sleep(0.5)


async def test_eliza_characters_of_every_shape_load_answer_and_show_their_examples(
    isolated_suite: Suite,
) -> None:
    suite = await isolated_suite.start(PARLEY_TRAJECTORY_LOGGING="true")
    auth = [("authorization", f"Bearer {suite.env.token}")]
    env = cli_env(suite)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{suite.runtime.grpc_port}") as channel:
        runtime = runtime_pb2_grpc.RuntimeStub(channel)
        agents: dict[str, runtime_pb2.Agent] = {}
        for name, file in FILES.items():
            # Over the API, as written: file knowledge entries are reported, never read.
            via_api = await runtime.UpsertAgent(
                runtime_pb2.UpsertAgentRequest(character=(CHARACTERS / file).read_text()),
                metadata=auth,
                timeout=10,
            )
            assert via_api.name == name
            agents[name] = via_api
            # And with the CLI, which reads the knowledge files next to the character file.
            added = await asyncio.to_thread(run, ["agents", "add", str(CHARACTERS / file)], env)
            assert added.returncode == 0, added.stderr
            assert f"saved agent {name} ({via_api.id}), enabled" in added.stdout
            if name == "Orion":
                assert any("was not read" in w and "faq.md" in w for w in via_api.warnings)
                plugin_warnings = [w for w in added.stderr.splitlines() if "no Parley equivalent" in w]
                assert plugin_warnings == [
                    "warning: elizaOS plugins with no Parley equivalent, not loaded (their actions, "
                    "providers and services are missing): @elizaos/plugin-solana, @elizaos/plugin-twitter"
                ]
                assert "image.png: only" in added.stderr  # not a text file: skipped, said so
                assert "was not read" not in added.stderr
            if name == "Vega":
                assert "keys Parley does not use, kept in the stored character: advancedMemory, " in (
                    added.stderr
                )
                assert "postCreationTemplate" in added.stderr
            if name == "Trinity":
                assert any("modelProvider 'openai'" in w for w in via_api.warnings)
                assert any("clients discord, twitter" in w for w in via_api.warnings)

        listed = await asyncio.to_thread(run, ["agents"], env)
        assert all(name in listed.stdout for name in FILES), listed.stdout

        questions = {
            "Trinity": "when is the lamp lit",
            "Orion": "what can I see tonight",
            "Vega": "a train to Paris please",
        }
        for name, question in questions.items():
            sent = await runtime.SendMessage(
                runtime_pb2.SendMessageRequest(agent_id=name, text=question, timeout_seconds=30),
                metadata=auth,
                timeout=40,
            )
            assert [r.text for r in sent.replies] == [f"You said: {question}"], name
            trajectory = await _turn(runtime, auth, agents[name], sent)
            stable, prompt = _planner_prompt(trajectory)
            assert "{{" not in prompt, name  # every placeholder filled in
            # The built-in SEND_MESSAGE action's example reaches the planner, names filled in.
            assert "Alex: tell the ops channel the deploy is done" in stable, name
            assert f"{name}: <actions>SEND_MESSAGE</actions>" in stable, name
            for secret in SECRETS:
                assert secret not in json.dumps(trajectory)
            if name == "Trinity":  # 0.x: `user` examples, lore, no planner template
                assert "Alex: When is high tide today?" in stable
                assert "Trinity: Check the tide table by the door, Alex:" in stable
                assert "Sam: The sky looks grey." in stable
                assert "batten the shutters. (actions: NONE)" in stable
                assert "Lore: She once guided a ferry home" in stable
                assert "Posts in your voice:\n- Fog rolled in at six." in stable
            if name == "Orion":  # 1.x: `name` examples, its messageHandlerTemplate
                assert stable.startswith("# Agent\nYou are Orion.\nYou are Orion, an amateur astronomer.")
                assert "<task>Generate dialog and actions for the character Orion.</task>" in stable
                assert "Alex: What is that bright star near the moon?" in stable
                assert (
                    "Orion: Tonight that is Jupiter, Alex: a planet, not a star. (actions: REPLY)" in stable
                )
                assert "<actions>\nPossible response actions: " in stable
                assert "<providers>\n" in prompt
                assert "# About Orion" in prompt
            if name == "Vega":  # current: {"examples": [...]} groups, its own template
                assert "# Vega's own planner\nYou are Vega. Be brief." in stable
                assert "Vega: Take the Nightjet from Wien Hbf" in stable
                assert "Alex: Are there sleeper cabins?" in stable
                assert "# Output format" in prompt  # its template has none: Parley's is added

        # 0.x shouldRespondTemplate decides in a group room (it answers "[RESPOND]").
        bus = await suite.connect()
        try:
            group = inbound(
                "any news about the tide",
                agent_id=agents["Trinity"].id,
                room_type=runtime_pb2.ROOM_TYPE_GROUP,
            )
            await publish_inbound(bus, group)
            for _ in range(100):
                if found := await replies_to(bus, group):
                    break
                await asyncio.sleep(0.3)
            assert [r.text for r in found] == ["You said: any news about the tide"]
        finally:
            await bus.close()
        turn_id = ids.message_id(uuid.UUID(agents["Trinity"].id), "e2e", group.message_id)
        recorded = await runtime.GetTurn(
            runtime_pb2.GetTurnRequest(agent_id="Trinity", turn_id=str(turn_id)), metadata=auth, timeout=10
        )
        decided = json.loads(recorded.trajectory_json)["should_respond"]
        assert decided["template"] == "shouldRespondTemplate"
        assert decided["prompt"].startswith(
            "# Task: Decide whether Trinity should respond to the last message."
        )
        assert "Trinity keeps a lighthouse on a rocky coast." in decided["prompt"]
        assert decided["output"] == "[RESPOND]"

        # Knowledge: strings and the files the CLI read are the agents' documents, each once,
        # although both the API and the CLI loaded every character (and the runtime reloaded them).
        orion = await _documents(channel, auth, "Orion", 3)
        assert orion == [
            "The Andromeda galaxy is the farthest object most people can see without a telescope."[:80],
            "eliza_knowledge/faq.md",
            "eliza_knowledge/guides/observing.txt",
        ]
        assert len(await _documents(channel, auth, "Trinity", 2)) == 2
        assert len(await _documents(channel, auth, "Vega", 2)) == 2

    # Secrets written in settings.secrets are stored encrypted like the others, not in the document.
    with psycopg.connect(suite.env.database_url) as conn:
        stored = conn.execute(
            "SELECT name, character::text FROM runtime.agent WHERE name = ANY(%s)", (list(FILES),)
        ).fetchall()
    assert len(stored) == 3
    for _, document in stored:
        for secret in SECRETS:
            assert secret not in document
    vega = json.loads(next(doc for name, doc in stored if name == "Vega"))
    assert vega["extra"] == {"advancedPlanning": True, "advancedMemory": False}
    assert vega["elizaPlugins"][0] == "@elizaos/plugin-sql"
