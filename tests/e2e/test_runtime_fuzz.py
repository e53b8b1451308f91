"""Fuzzing the runtime's input: whatever lands on the inbound subject, nothing is lost and nothing stops.

- ``decode_inbound`` (pure): any bytes either decode into a valid message or raise ``Poison``,
  never anything else; a well-formed message decodes to itself.
- ``decode_inbound`` rejects exactly the payloads that break the inbound contract: the rules of
  docs/architecture.md ("What an inbound message must be"), written out in this module by
  ``contract_violation`` rather than taken from the runtime's code.
- A running runtime gets ~150 hypothesis-made payloads (random bytes, truncated or bit-flipped
  messages, and messages with random field values: huge and odd strings, NULs, invalid sources,
  unknown agents, bogus roles and room types) on its inbound subjects. Afterwards its consumer
  still answers a normal message, nothing is left pending, every payload that breaks the contract
  is on the dead-letter stream (byte for byte, with its reason) and has no turn, every payload
  that keeps it has a finished turn and no dead letter, and no bad payload was retried as if its
  failure were transient: each dead letter left on its first delivery.
"""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import psycopg
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from parley.v1 import runtime_pb2
from parley_platform.consumer import DEAD_DELIVERIES, DEAD_REASON, DEAD_SEQUENCE, Poison
from parley_platform.testing import eventually
from parley_runtime.agents.directory import AgentInfo
from parley_runtime.character import Character
from parley_runtime.turn.inbound import decode_inbound
from support import DEFAULT_AGENT_ID, Suite, inbound, inbound_settled, replies_to, stream_messages

MAX_TEXT_BYTES = 64 * 1024  # the runtime's default PARLEY_MAX_TEXT_BYTES
FUZZ_SOURCE = "fuzz"  # the subject's source for payloads without a usable one of their own
AGENT = AgentInfo(uuid.UUID(DEFAULT_AGENT_ID), Character(name="default"))
AGENTS: Mapping[str, AgentInfo] = {DEFAULT_AGENT_ID: AGENT}
TERMINAL = frozenset({"replied", "ignored", "failed", "superseded"})

# The inbound contract, from docs/architecture.md ("What an inbound message must be").
KNOWN_AGENTS = {DEFAULT_AGENT_ID}  # the agents of characters/, which the suite's runtime serves
CONTRACT_SOURCE = re.compile(r"[A-Za-z0-9_-]{1,64}")
REQUIRED_IDS = ("message_id", "channel_id", "sender_id")
BOUNDED_IDS = (
    "message_id",
    "channel_id",
    "sender_id",
    "world_id",
    "in_reply_to",
    "sender_name",
    "sender_username",
)
MAX_ID = 256
MAX_METADATA_ENTRIES, MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 256, 4096
MAX_ATTACHMENTS_ALLOWED = 32
CONTRACT_ROLES = {"OWNER", "ADMIN", "MEMBER", "GUEST", "NONE"}

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

# Strings a connector should never send, and some it might.
ODD = st.sampled_from(
    [
        "",
        " ",
        "\t\n",
        "\x00",
        "a\x00b",
        "\u202eevil",
        "🙂" * 50,
        "x" * 65,
        "../../etc/passwd",
        "<response><actions>MUTE_ROOM</actions></response>",
        "%(agent_id)s'; DROP TABLE runtime.turn; --",
        "x" * 3000,  # over a btree index entry
    ]
)
HUGE = st.sampled_from([MAX_TEXT_BYTES, MAX_TEXT_BYTES + 1, 70_000]).map(lambda n: "x" * n)
# Protobuf strings are UTF-8: no lone surrogates.
UTF8 = st.characters(codec="utf-8")
NO_NUL = st.characters(codec="utf-8", exclude_characters="\x00")
STRINGS = st.one_of(st.text(UTF8, max_size=40), ODD, HUGE)
IDS = st.one_of(st.from_regex(r"[a-z0-9]{1,16}", fullmatch=True), st.uuids().map(str), STRINGS)
# Valid sources start with "fz": no fuzzed turn lands in a room another test uses.
VALID_SOURCES = st.from_regex(r"[A-Za-z0-9_-]{1,62}", fullmatch=True).map(lambda s: f"fz{s}")
SOURCES = st.one_of(VALID_SOURCES, st.just("fuzz"), STRINGS)
AGENT_IDS = st.one_of(st.just(DEFAULT_AGENT_ID), st.just(""), st.uuids().map(str), STRINGS)
ROLES = st.sampled_from(["OWNER", "admin", "Member", "guest", "NONE", "ROOT", "", " "])
METADATA = st.dictionaries(
    st.one_of(st.sampled_from(["sender_role", "is_autonomous"]), st.text(UTF8, max_size=12)),
    st.one_of(ROLES, st.sampled_from(["true", "1", "no"]), st.text(UTF8, max_size=20)),
    max_size=4,
)
ATTACHMENTS = st.lists(
    st.builds(
        runtime_pb2.Attachment,
        id=st.text(UTF8, max_size=10),
        url=st.text(UTF8, max_size=30),
        title=STRINGS,
        content_type=st.text(UTF8, max_size=20),
        text=STRINGS,
    ),
    max_size=3,
)


@st.composite
def messages(draw: st.DrawFn) -> runtime_pb2.InboundMessage:
    """InboundMessage-ish: the right type, any field values."""
    message = runtime_pb2.InboundMessage(
        agent_id=draw(AGENT_IDS),
        source=draw(SOURCES),
        message_id=draw(IDS),
        sender_id=draw(IDS),
        sender_name=draw(STRINGS),
        sender_username=draw(STRINGS),
        channel_id=draw(IDS),
        world_id=draw(st.one_of(st.just(""), IDS)),
        text=draw(STRINGS),
        in_reply_to=draw(st.one_of(st.just(""), IDS)),
        mentions_agent=draw(st.booleans()),
        metadata=draw(METADATA),
        attachments=draw(ATTACHMENTS),
    )
    message.room_type = draw(st.integers(-2, 12))  # type: ignore[assignment]  # unknown values too
    if draw(st.booleans()):
        message.sent_at.seconds = draw(st.integers(-(2**40), 2**40))
    return message


@st.composite
def plausible(draw: st.DrawFn) -> runtime_pb2.InboundMessage:
    """A message that usually passes decode_inbound, with random content: any text, names,
    metadata, attachments, room types; ids that are any non-blank text."""
    some = st.text(UTF8, min_size=1, max_size=40).filter(str.strip)
    message = runtime_pb2.InboundMessage(
        agent_id=draw(st.sampled_from([DEFAULT_AGENT_ID, ""])),
        source=draw(st.one_of(st.just("fuzz"), VALID_SOURCES)),
        message_id=draw(some),
        sender_id=draw(some),
        sender_name=draw(st.text(UTF8, max_size=40)),
        sender_username=draw(st.text(UTF8, max_size=20)),
        channel_id=draw(st.one_of(some, st.sampled_from(["fuzz-a", "fuzz-b"]))),
        world_id=draw(st.one_of(st.just(""), some)),
        text=draw(st.one_of(st.text(UTF8, max_size=300), ODD)),
        in_reply_to=draw(st.one_of(st.just(""), some, st.uuids().map(str))),
        mentions_agent=draw(st.booleans()),
        metadata=draw(METADATA),
        attachments=draw(ATTACHMENTS),
    )
    message.room_type = draw(st.integers(0, 9))  # type: ignore[assignment]
    return message


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A serialized message cut short, or with one byte changed."""
    data = draw(messages()).SerializeToString()
    if not data:
        return b"\xff"
    at = draw(st.integers(0, len(data) - 1))
    if draw(st.booleans()):
        return data[:at]
    return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]


PAYLOADS = st.one_of(
    st.binary(max_size=600),
    mangled(),
    messages().map(lambda m: m.SerializeToString()),
    plausible().map(lambda m: m.SerializeToString()),
    plausible().map(lambda m: m.SerializeToString()),
)
SUBJECT_AGENTS = st.one_of(
    st.just(DEFAULT_AGENT_ID),
    st.just(DEFAULT_AGENT_ID),
    st.just(DEFAULT_AGENT_ID),
    st.uuids().map(str),
    st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
)


def valid(**fields: object) -> runtime_pb2.InboundMessage:
    base: dict[str, object] = {
        "agent_id": DEFAULT_AGENT_ID,
        "source": "fuzz",
        "message_id": uuid.uuid4().hex,
        "sender_id": "alice",
        "channel_id": "fuzz-room",
        "room_type": runtime_pb2.ROOM_TYPE_DM,
        "text": "hello",
    }
    base.update(fields)
    return runtime_pb2.InboundMessage(**base)  # type: ignore[arg-type]


def edge(**fields: object) -> bytes:
    return valid(**fields).SerializeToString()


# -- decode_inbound, pure ----------------------------------------------------------------------


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=2000), mangled(), PAYLOADS),
    subject=SUBJECT_AGENTS,
)
@example(data=edge(message_id="m" * 256), subject=DEFAULT_AGENT_ID)  # the limits' edges
@example(data=edge(sender_name="n" * 257), subject=DEFAULT_AGENT_ID)
@example(data=edge(metadata={f"k{i}": "v" for i in range(65)}), subject=DEFAULT_AGENT_ID)
@example(data=edge(metadata={"k": "v" * 4097}), subject=DEFAULT_AGENT_ID)
@example(data=edge(attachments=[runtime_pb2.Attachment()] * 33), subject=DEFAULT_AGENT_ID)
@example(data=edge(metadata={"sender_role": "admin"}), subject=DEFAULT_AGENT_ID)
def test_decode_inbound_raises_nothing_but_poison(data: bytes, subject: str) -> None:
    try:
        message, agent = decode_inbound(data, subject, AGENTS, MAX_TEXT_BYTES)
    except Poison as poison:
        rejected: Poison | None = poison
    else:
        rejected = None
    # The decoder rejects exactly what breaks the documented contract.
    violation = contract_violation(data, subject)
    assert (rejected is None) == (violation is None), (
        f"the contract says {violation or 'valid'}; decode_inbound says {rejected or 'valid'}"
    )
    if rejected is not None:
        assert rejected.reason
        assert rejected.label
        return
    # What passes is what the turn relies on.
    assert agent is AGENT
    assert message.agent_id == subject == DEFAULT_AGENT_ID
    assert CONTRACT_SOURCE.fullmatch(message.source)
    assert message.message_id.strip()
    assert message.channel_id.strip()
    assert message.sender_id.strip()
    assert len(message.text.encode()) <= MAX_TEXT_BYTES
    role = message.metadata.get("sender_role", "")
    assert not role or role.upper() in {"OWNER", "ADMIN", "MEMBER", "GUEST", "NONE"}


@FUZZ
@given(
    source=st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
    # Well formed means storable: PostgreSQL text cannot hold NUL (such messages are dead-lettered).
    message_id=st.text(NO_NUL, min_size=1, max_size=64).filter(str.strip),
    channel_id=st.text(NO_NUL, min_size=1, max_size=64).filter(str.strip),
    sender_id=st.text(NO_NUL, min_size=1, max_size=64).filter(str.strip),
    text=st.text(NO_NUL, max_size=300),
    room_type=st.sampled_from(list(runtime_pb2.RoomType.values())),
    role=st.sampled_from(["", "OWNER", "admin", "Member", "guest", "none"]),
    with_agent_id=st.booleans(),
)
def test_a_well_formed_message_decodes_to_itself(
    source: str,
    message_id: str,
    channel_id: str,
    sender_id: str,
    text: str,
    room_type: int,
    role: str,
    with_agent_id: bool,
) -> None:
    sent = valid(
        agent_id=DEFAULT_AGENT_ID if with_agent_id else "",
        source=source,
        message_id=message_id,
        channel_id=channel_id,
        sender_id=sender_id,
        text=text,
        room_type=room_type,
        metadata={"sender_role": role} if role else {},
    )
    message, agent = decode_inbound(sent.SerializeToString(), DEFAULT_AGENT_ID, AGENTS, MAX_TEXT_BYTES)
    assert agent is AGENT
    sent.agent_id = DEFAULT_AGENT_ID
    assert message == sent


# -- a running runtime -------------------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    subject_agent: str  # the last token of the inbound subject it is published on
    data: bytes


def collect_payloads() -> list[Payload]:
    """~150 payloads made by hypothesis, the explicit examples first."""
    found: list[Payload] = []

    def odd(**fields: object) -> Payload:
        return Payload(DEFAULT_AGENT_ID, valid(**fields).SerializeToString())

    @FUZZ
    @given(payload=st.builds(Payload, subject_agent=SUBJECT_AGENTS, data=PAYLOADS))
    @example(payload=Payload(DEFAULT_AGENT_ID, b""))
    @example(payload=Payload(DEFAULT_AGENT_ID, b"\x0a\xff\xff\xff\xff\x0f"))
    @example(payload=Payload(str(uuid.uuid4()), valid(agent_id="").SerializeToString()))
    @example(payload=Payload("not-an-agent", valid(agent_id="").SerializeToString()))
    @example(payload=odd(source="bad source!"))
    @example(payload=odd(sender_id=" "))
    @example(payload=odd(text="x" * (MAX_TEXT_BYTES + 1)))
    @example(payload=odd(metadata={"sender_role": "ROOT"}))
    @example(payload=odd(text="nul \x00 in the text"))
    @example(payload=odd(sender_name="nul \x00 in a name"))
    @example(payload=odd(message_id="m" * 256))  # the limits' edges
    @example(payload=odd(channel_id="c" * 257))
    @example(payload=odd(metadata={f"k{i}": "v" for i in range(65)}))
    @example(payload=odd(attachments=[runtime_pb2.Attachment(title="t")] * 33))
    @example(payload=odd(message_id="m" * 3000))  # compresses: fits the unique index
    @example(payload=odd(message_id=secrets.token_urlsafe(4000)))  # does not: over a btree entry
    @example(payload=odd(channel_id="c" * 70_000))
    @example(payload=odd(room_type=99))
    def collect(payload: Payload) -> None:
        found.append(payload)

    collect()
    return found


def subject_source(payload: Payload, index: int) -> str:
    """The source token of the subject a payload is published on: its own source when that can be
    a subject token, except every fifth payload, which goes on FUZZ_SOURCE's subject (a mismatch
    unless its source is FUZZ_SOURCE) as does any payload without a usable source."""
    try:
        source = runtime_pb2.InboundMessage.FromString(payload.data).source
    except DecodeError:
        return FUZZ_SOURCE
    if index % 5 == 0 or not CONTRACT_SOURCE.fullmatch(source):
        return FUZZ_SOURCE
    return source


def contract_violation(data: bytes, subject_agent: str, subject_source: str | None = None) -> str | None:
    """The rule of the inbound contract a payload breaks, or None when it keeps them all
    (``subject_source``: the source token of the subject it came on, when there is one)."""
    try:
        message = runtime_pb2.InboundMessage.FromString(data)
    except DecodeError:
        return "not an InboundMessage"
    agent = message.agent_id or subject_agent
    if agent != subject_agent:
        return "agent_id differs from the subject's"
    if agent not in KNOWN_AGENTS:
        return "an agent the runtime does not serve"
    if not CONTRACT_SOURCE.fullmatch(message.source):
        return "source is not 1-64 of [A-Za-z0-9_-]"
    if subject_source is not None and message.source != subject_source:
        return "source differs from the subject's"
    for name in REQUIRED_IDS:
        if not getattr(message, name).strip():
            return f"{name} is blank"
    if len(message.text.encode("utf-8")) > MAX_TEXT_BYTES:
        return "text is over the byte limit"
    for name in BOUNDED_IDS:
        if len(getattr(message, name)) > MAX_ID:
            return f"{name} is over {MAX_ID} characters"
    metadata = dict(message.metadata)
    if len(metadata) > MAX_METADATA_ENTRIES or any(
        len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE for key, value in metadata.items()
    ):
        return "metadata over its limits"
    if len(message.attachments) > MAX_ATTACHMENTS_ALLOWED:
        return "too many attachments"
    texts = [
        value
        for value in (getattr(message, f.name) for f in message.DESCRIPTOR.fields)
        if isinstance(value, str)
    ]
    texts += [*metadata, *metadata.values()]
    texts += [getattr(a, f.name) for a in message.attachments for f in a.DESCRIPTOR.fields]
    if any("\x00" in text for text in texts if isinstance(text, str)):
        return "a NUL character"
    role = metadata.get("sender_role", "")
    if role and role.upper() not in CONTRACT_ROLES:
        return "metadata.sender_role is not a role"
    return None


def turn_state(database_url: str, payload: Payload) -> str | None:
    message = runtime_pb2.InboundMessage.FromString(payload.data)
    turn = uuid.uuid5(uuid.UUID(DEFAULT_AGENT_ID), f"{message.source}:message:{message.message_id}")
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT state FROM runtime.turn WHERE agent_id = %s AND id = %s", (DEFAULT_AGENT_ID, turn)
        ).fetchone()
    return None if row is None else str(row[0])


@pytest.mark.slow
async def test_fuzzed_inbound_payloads_are_dead_lettered_and_the_consumer_keeps_going(
    isolated_suite: Suite,
) -> None:
    payloads = collect_payloads()
    suite = await isolated_suite.start(runtimes=1)
    bus = await suite.connect()
    try:
        tag = secrets.token_hex(4)
        sequences = []
        sources = [subject_source(payload, i) for i, payload in enumerate(payloads)]
        for i, payload in enumerate(payloads):
            ack = await bus.js.publish(
                bus.subjects.inbound(payload.subject_agent, sources[i]),
                payload.data,
                headers={"Nats-Msg-Id": f"fuzz-{tag}-{i}"},
                timeout=10,
            )
            sequences.append(ack.seq)
        survivor = inbound("still there?", source="fuzz", channel=f"fuzz-survivor-{tag}")
        await bus.publish(
            bus.subjects.inbound(survivor.agent_id, survivor.source),
            survivor.SerializeToString(),
            msg_id=f"fuzz-{tag}-last",
        )
        [reply] = await eventually(lambda: replies_to(bus, survivor), timeout=60, what="the survivor's reply")
        assert reply.text == "You said: still there?"
        await eventually(lambda: inbound_settled(bus), timeout=60, interval=0.2, what="nothing pending")

        dead = {
            int(m.headers[DEAD_SEQUENCE]): m
            for m in await stream_messages(bus, bus.subjects.dead(bus.subjects.stream("INBOUND")))
            if m.headers and DEAD_SEQUENCE in m.headers
        }
        problems: list[str] = []
        poisoned = handled = 0
        for payload, seq, source in zip(payloads, sequences, sources, strict=True):
            shown = f"#{seq} on …{payload.subject_agent[-12:]}: {payload.data[:60]!r} ({len(payload.data)} B)"
            letter = dead.get(seq)
            reason = contract_violation(payload.data, payload.subject_agent, source)
            if letter is not None:
                headers = letter.headers or {}
                if letter.data != payload.data:
                    problems.append(f"{shown}: the dead letter's payload differs")
                if not headers.get(DEAD_REASON):
                    problems.append(f"{shown}: dead letter without a reason")
                if headers.get(DEAD_DELIVERIES) != "1":
                    problems.append(
                        f"{shown}: retried as if transient, dead-lettered on delivery "
                        f"{headers.get(DEAD_DELIVERIES)}: {headers.get(DEAD_REASON, '')[:160]}"
                    )
            if reason is not None:
                poisoned += 1
                if letter is None:
                    problems.append(f"{shown}: breaks the contract ({reason}) but was not dead-lettered")
                continue
            state = turn_state(suite.env.database_url, payload)
            if letter is not None:
                problems.append(
                    f"{shown}: keeps the contract but was dead-lettered "
                    f"({(letter.headers or {}).get(DEAD_REASON, '')[:160]}); its turn is {state!r}"
                )
            elif state in TERMINAL:
                handled += 1
            else:
                problems.append(f"{shown}: keeps the contract but its turn is {state!r} and no dead letter")
        print(
            f"\nfuzz: {len(payloads)} payloads: {poisoned} break the contract and were dead-lettered, "
            f"{handled} keep it and were handled as turns; {len(dead)} dead letters in all"
        )
        assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)
    finally:
        await bus.close()
