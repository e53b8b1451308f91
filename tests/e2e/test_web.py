"""The web connector as its users meet it: the official `openai` client against the real service
(gateway, runtime, pairing and web as processes, real NATS and Postgres), streaming and not, with
the errors in OpenAI's shape and status; a user's room persisting across requests; a revoked key
refused."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import uuid
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from parley.v1 import pairing_pb2, runtime_pb2
from parley_devinfra.infra import free_port
from parley_platform.testing import ServiceProcess, eventually
from support import SessionEnv, turn_of
from web_support import Web, start_web, web_fixture


@pytest.fixture(scope="module")
async def web(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Web]:
    async for running in web_fixture(test_env, tmp_path_factory):
        yield running


async def test_a_completion_is_the_agents_reply(web: Web) -> None:
    completion = await web.client().chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello there"}],
        user="ann",
    )
    assert completion.object == "chat.completion"
    [choice] = completion.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    reply = await web.reply_to(completion.id)
    assert choice.message.content == reply.text
    assert "hello there" in reply.text


async def test_a_streamed_completion_adds_up_to_the_reply(web: Web) -> None:
    stream = await web.client().chat.completions.create(
        model="default", messages=[{"role": "user", "content": "tell me a story"}], user="ann", stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == (await web.reply_to(chunks[0].id)).text
    assert "tell me a story" in text


async def test_models_lists_the_keys_agent(web: Web) -> None:
    models = await web.client().models.list()
    assert [m.id for m in models.data] == ["default"]


async def test_a_wrong_key_gets_401_in_openai_shape(web: Web) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        await web.client(key="sk-" + secrets.token_urlsafe(24)).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 401
    body = caught.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "invalid_request_error"
    async with httpx.AsyncClient() as http:
        missing = await http.get(f"{web.url}/v1/models")
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"


async def test_an_unknown_model_gets_404(web: Web) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await web.client().chat.completions.create(
            model="nobody-" + uuid.uuid4().hex[:6], messages=[{"role": "user", "content": "hi"}]
        )
    error = caught.value.response.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model is required"),
        (b'{"model": "default"}', "messages must be"),
        (b'{"model": "default", "messages": [{"role": "system", "content": "x"}]}', "no user message"),
        (b'{"model": "default", "messages": [{"role": "user", "content": 42}]}', "content must be"),
        (b'{"model": "default", "messages": [{"role": "user", "content": "x"}], "stream": "y"}', "stream"),
    ],
)
async def test_a_malformed_body_gets_400_saying_what_is_wrong(web: Web, body: bytes, says: str) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{web.url}/v1/chat/completions",
            content=body,
            headers={"Authorization": f"Bearer {web.key}", "Content-Type": "application/json"},
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert says in error["message"]


async def test_a_users_room_persists_across_requests(web: Web) -> None:
    client = web.client()
    user = f"bob-{secrets.token_hex(3)}"
    for text in ("first words", "second words"):
        await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": text}], user=user
        )
    async with httpx.AsyncClient() as http:
        history = await http.get(
            f"{web.url}/api/history",
            params={"model": "default", "user": user},
            headers={"Authorization": f"Bearer {web.key}"},
        )
        other = await http.get(
            f"{web.url}/api/history",
            params={"model": "default", "user": "someone-else"},
            headers={"Authorization": f"Bearer {web.key}"},
        )
    messages = history.json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages[::2]] == ["first words", "second words"]
    assert all("words" not in m["content"] for m in other.json()["messages"])


async def test_a_revoked_key_is_refused(web: Web) -> None:
    name = f"gone-{secrets.token_hex(3)}"
    key = await web.add_key(name)
    assert [m.id for m in (await web.client(key).models.list()).data] == ["default"]
    await web.pairing.RevokeConnector(pairing_pb2.RevokeConnectorRequest(name=name))
    with pytest.raises(openai.AuthenticationError):
        await web.client(key).models.list()


async def test_no_reply_in_time_gets_504(web: Web) -> None:
    # A web replica of its own with a short deadline; the scripted model takes 8 s for this one.
    url = await start_web(web.suite, PARLEY_WEB_REPLY_TIMEOUT_SECONDS="1")
    client = web.client(url=url)
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "please be very slow"}]
            )
        assert caught.value.status_code == 504
        assert caught.value.response.json()["error"]["code"] == "reply_timeout"
    finally:
        web.suite.others.pop().stop()


async def test_a_reader_that_goes_away_cancels_the_turn(web: Web) -> None:
    """The stream is closed after its first words: the runtime is asked to stop generating."""
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream(
            "POST",
            f"{web.url}/v1/chat/completions",
            json={
                "model": "default",
                "stream": True,
                "messages": [{"role": "user", "content": "please stream slowly"}],
            },
            headers={"Authorization": f"Bearer {web.key}"},
        ) as response,
    ):
        assert response.status_code == 200
        completion_id = ""
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                completion_id = chunk["id"]
                if chunk["choices"][0]["delta"].get("content"):
                    break
    message = runtime_pb2.InboundMessage(source="web", message_id=completion_id.removeprefix("chatcmpl-"))

    async def cancelled() -> bool:
        found = turn_of(web.suite.env.database_url, message)
        return found is not None and found[0] == "cancelled"

    await eventually(cancelled, timeout=20, what="the turn cancelled")


async def test_a_taken_http_port_stops_the_service_saying_which(web: Web) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        grpc = free_port()
        process = ServiceProcess(
            "parley_web",
            web.suite.env.service_env(
                PARLEY_NAMESPACE=web.suite.namespace,
                PARLEY_WEB_PORT=str(port),
                PARLEY_WEB_GRPC_PORT=str(grpc),
                PARLEY_WEB_METRICS_PORT=str(free_port()),
            ),
            web.suite.logs / "web-taken.log",
            grpc,
        ).start()
        try:
            assert process.process is not None
            code = await asyncio.to_thread(process.process.wait, 30)
        finally:
            process.stop()
    assert code != 0
    assert "PORT_IN_USE" in process.log()
    assert f"127.0.0.1:{port} (PARLEY_WEB_PORT)" in process.log()
