"""The connector kit's plain parts: credentials files and environments, inbound messages."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from parley.v1 import runtime_pb2
from parley_connectors import Attachment, Credentials, Inbound
from parley_platform.errors import ParleyError

FILE = {
    "name": "tg",
    "nats_url": "nats://127.0.0.1:4222",
    "user": "tg",
    "password": "s3cret-pass",
    "agent_id": "a1",
    "source": "telegram",
    "namespace": "parley",
    "inbound_subject": "parley.inbound.a1.telegram",
    "outbound_subject": "parley.outbound.a1.telegram",
    "outbound_stream": "PARLEY_OUTBOUND",
    "durable": "connector-tg",
    "inbox_prefix": "_INBOX.connector.tg",
    "stream_subject": "parley.stream.a1.telegram",
    "cancel_subject": "parley.cancel.a1.telegram",
}


def test_the_file_of_connectors_add_loads_and_its_subjects_match_the_derived_ones(tmp_path: Path) -> None:
    path = tmp_path / "tg.json"
    path.write_text(json.dumps(FILE))
    loaded = Credentials.load(path)
    assert loaded == Credentials(
        **{k: FILE[k] for k in ("name", "nats_url", "password", "agent_id", "source")}
    )
    assert "s3cret" not in repr(loaded)


def test_from_env_reads_the_named_file_or_the_fields(tmp_path: Path) -> None:
    path = tmp_path / "tg.json"
    path.write_text(json.dumps(FILE))
    assert Credentials.from_env({"PARLEY_CONNECTOR_CREDENTIALS": str(path)}).durable == "connector-tg"
    fields = {f"PARLEY_CONNECTOR_{k.upper()}": FILE[k] for k in ("name", "nats_url", "password", "agent_id")}
    fields["PARLEY_CONNECTOR_SOURCE"] = "slack"
    fields["PARLEY_CONNECTOR_NAMESPACE"] = "x"
    creds = Credentials.from_env(fields)
    assert (creds.inbound_subject, creds.inbox_prefix) == ("x.inbound.a1.slack", "_INBOX.connector.tg")


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read"),
        ("{not json", "is not JSON"),
        ("[1]", "not a JSON object"),
        (json.dumps({**FILE, "password": ""}), "lack 'password'"),
        (json.dumps({k: v for k, v in FILE.items() if k != "source"}), "lack 'source'"),
        (json.dumps({**FILE, "agent_id": 7}), "'agent_id' is not a string"),
    ],
)
def test_a_bad_credentials_file_is_a_clear_error_without_the_password(
    tmp_path: Path, content: str | None, says: str
) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ParleyError) as caught:
        Credentials.load(path)
    assert caught.value.code == "CREDENTIALS_INVALID"
    assert says in str(caught.value)
    assert "s3cret" not in str(caught.value)


def test_from_env_without_anything_says_what_to_set() -> None:
    with pytest.raises(ParleyError) as caught:
        Credentials.from_env({})
    assert "PARLEY_CONNECTOR_CREDENTIALS" in str(caught.value)


def test_an_inbound_message_carries_everything_to_the_wire() -> None:
    sent = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    wire = Inbound(
        message_id="42",
        sender_id="u1",
        sender_name="Ann",
        sender_username="ann",
        channel_id="g1",
        text="@bot look",
        room_type="thread",
        mentions_agent=True,
        in_reply_to="41",
        attachments=[Attachment(id="f1", url="https://x/f1", content_type="image/png")],
        world_id="w1",
        metadata={"thread_ts": "1.2"},
        sent_at=sent,
    ).to_proto("a1", "slack")
    assert (wire.agent_id, wire.source, wire.message_id, wire.room_type) == (
        "a1",
        "slack",
        "42",
        runtime_pb2.ROOM_TYPE_THREAD,
    )
    assert (wire.mentions_agent, wire.in_reply_to, wire.world_id) == (True, "41", "w1")
    assert wire.attachments[0].url == "https://x/f1"
    assert dict(wire.metadata) == {"thread_ts": "1.2"}
    assert wire.sent_at.ToDatetime(dt.UTC) == sent
    plain = Inbound(message_id="1", sender_id="u2", text="hi").to_proto("a1", "tg")
    assert (plain.channel_id, plain.sender_name, plain.room_type) == ("tg:u2", "u2", runtime_pb2.ROOM_TYPE_DM)


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (Inbound(message_id="", sender_id="u", text="x"), "needs a message_id"),
        (Inbound(message_id="1", sender_id="", text="x"), "needs a sender_id"),
        (Inbound(message_id="1", sender_id="u", text="x", room_type="lobby"), "room_type 'lobby'"),  # type: ignore[arg-type]
    ],
)
def test_an_incomplete_inbound_message_is_refused_before_the_bus(message: Inbound, says: str) -> None:
    with pytest.raises(ParleyError) as caught:
        message.to_proto("a1", "tg")
    assert caught.value.code == "INBOUND_INVALID"
    assert says in str(caught.value)
