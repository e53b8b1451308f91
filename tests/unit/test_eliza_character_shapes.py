"""elizaOS character documents brought to Parley's shape (parley_runtime.eliza), the templates'
placeholders (parley_runtime.templating) and the knowledge files a character names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parley_clients.character_files import inline_knowledge
from parley_platform.errors import InvalidArgument
from parley_runtime import templating
from parley_runtime.character import load_character_file, parse_character
from parley_runtime.plugins.catalog import describe
from parley_runtime.sdk import Action, ActionResult, State
from parley_runtime.turn.prompt import build_turn_prompt, join_segments

ROOT = Path(__file__).resolve().parents[2]
CHARACTERS = ROOT / "tests" / "characters"


@pytest.mark.parametrize(
    "group",
    [
        [{"user": "{{user1}}", "content": {"text": "hi"}}, {"user": "Eve", "content": {"text": "hello"}}],
        [{"name": "{{name1}}", "content": {"text": "hi"}}, {"name": "Eve", "content": {"text": "hello"}}],
        {"examples": [{"name": "{{user1}}", "content": {"text": "hi"}}, {"name": "Eve", "content": "hello"}]},
        [{"name": "{{user1}}", "text": "hi"}, {"name": "Eve", "text": "hello"}],
    ],
)
def test_every_message_example_shape_reads_the_same(group: object) -> None:
    character = parse_character({"name": "Eve", "messageExamples": [group]})
    assert templating.example_lines(character) == ["Alex: hi\nEve: hello"]


def test_strings_or_lists_and_secrets_of_any_scalar() -> None:
    character = parse_character(
        {
            "name": "Eve",
            "bio": "one line",
            "lore": "a story",
            "topics": "cats",
            "style": {"all": "short", "chat": ["warm"]},
            "secrets": {"PORT": 8080, "ON": True},
            "settings": {"secrets": {"PORT": "1", "TOKEN": "t"}, "voice": {"model": "x"}},
        }
    )
    assert (character.bio, character.lore, character.topics) == (["one line"], ["a story"], ["cats"])
    assert character.style == {"all": ["short"], "chat": ["warm"]}
    # settings.secrets join the (encrypted) secrets; a top-level one of the same name wins.
    assert character.secrets == {"PORT": "8080", "ON": "true", "TOKEN": "t"}
    assert "secrets" not in character.document()["settings"]


def test_plugins_mapped_and_the_missing_reported_in_one_warning() -> None:
    character = parse_character(
        {
            "name": "Eve",
            "plugins": [
                "@elizaos/plugin-sql",
                "@elizaos/plugin-bootstrap",
                "@elizaos/plugin-evm",
                "@elizaos/plugin-discord",
                "plugins.fixtures:fixtures_plugin",
            ],
        }
    )
    assert character.plugins == ["plugins.fixtures:fixtures_plugin"]
    assert character.eliza_plugins[:2] == ["@elizaos/plugin-sql", "@elizaos/plugin-bootstrap"]
    missing = [w for w in character.warnings if "no Parley equivalent" in w]
    assert len(missing) == 1
    assert missing[0].endswith(": @elizaos/plugin-evm, @elizaos/plugin-discord")


def test_unknown_keys_are_kept_and_reported_and_the_stored_document_reloads_unchanged() -> None:
    for file in ("eliza_v0.json", "eliza_v1.json", "eliza_current.json"):
        character = load_character_file(CHARACTERS / file)
        again = parse_character({**character.document(), "secrets": character.secrets})
        assert again.document() == character.document(), file
        assert again.secrets == character.secrets
    vega = load_character_file(CHARACTERS / "eliza_current.json")
    assert vega.extra == {"advancedPlanning": True, "advancedMemory": False}
    assert any("advancedMemory, advancedPlanning" in w for w in vega.warnings)
    assert any("postCreationTemplate" in w for w in vega.warnings)


def test_knowledge_files_are_read_next_to_the_character_only(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\ntext a")
    (tmp_path / "docs" / "b.bin").write_bytes(b"\x00\x01")
    (tmp_path / "one.txt").write_text("text one")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("never read")
    (tmp_path / "docs" / "link.txt").symlink_to(outside)
    document = {
        "knowledge": [
            "inline",
            {"path": "one.txt"},
            {"directory": "docs"},
            {"path": f"../{outside.name}"},
            {"path": "/etc/hostname"},
            {"path": "missing.txt"},
        ]
    }
    warnings = inline_knowledge(document, tmp_path)
    assert document["knowledge"] == [
        "inline",
        {"path": "one.txt", "text": "text one"},
        {"path": "docs/a.md", "text": "# A\ntext a"},
    ]
    assert len(warnings) == 5
    assert "'docs/link.txt' is outside the character file's directory" in warnings[1]
    assert "outside the character file's directory" in warnings[2]
    assert "never read" not in json.dumps(document)


def test_a_file_entry_sent_over_the_api_is_reported_not_read() -> None:
    character = parse_character({"name": "Eve", "knowledge": ["a fact", {"path": "/etc/passwd"}]})
    assert [k.text for k in character.knowledge] == ["a fact"]
    assert any("'/etc/passwd' was not read" in w for w in character.warnings)


def test_message_handler_template_is_the_planner_prompt_with_a_stable_prefix() -> None:
    character = parse_character(
        {
            "name": "Eve",
            "system": "Be kind.",
            "messageExamples": [[{"user": "{{user2}}", "content": {"text": "yo"}}]],
            "templates": {
                "messageHandlerTemplate": "Plan for {{agentName}}.\n{{characterMessageExamples}}\n"
                "{{actionNames}}\n<providers>{{providers}}</providers>\n{{unknownThing}}<response>"
            },
        }
    )
    state = State(texts={"ACTIONS": "# Available actions\n- REPLY: r", "TIME": "# Time\nnow"})
    state.values["actionNames"] = "Possible response actions: REPLY"
    segments = build_turn_prompt(character, state, "Ann", "hello")
    assert [s.stable for s in segments] == [True, False, False]
    assert segments[0].content == (
        "# Agent\nYou are Eve.\nBe kind.\n\n"
        "Plan for Eve.\nSam: yo\nPossible response actions: REPLY\n<providers>"
    )
    assert "# Time\nnow" in segments[1].content
    assert "{{" not in join_segments(segments)
    assert "# Output format" not in join_segments(segments)  # the template has its own
    assert segments[-1].content == "\n# Current message\nAnn: hello\n"


def test_action_examples_are_in_the_catalog() -> None:
    async def handler(*_: object) -> ActionResult:
        return ActionResult(True)

    action = Action("WAVE", "wave at someone", handler, examples=("{{user1}}: wave\n{{agentName}}: *waves*",))
    text = templating.names(describe([action]), "Eve")
    assert text == "- WAVE: wave at someone\n  Example:\n    Alex: wave\n    Eve: *waves*"


def test_a_bad_document_says_where() -> None:
    with pytest.raises(InvalidArgument) as failure:
        parse_character({"name": "Eve", "lore": [1, 2], "knowledge": "not a list"})
    assert "lore.0" in failure.value.message
    assert "knowledge" in failure.value.message


@pytest.mark.parametrize(
    ("document", "where"),
    [
        ({"name": "a", "elizaPlugins": 5}, "elizaPlugins"),
        ({"name": "a", "messageExamples": [{"examples": 5}]}, "messageExamples.0"),
        ({"name": "a", "messageExamples": [[{"content": [1]}]]}, "messageExamples.0.0.text"),
        ({"name": "a", "knowledge": [5]}, "knowledge.0"),
        ({"name": "a", "settings": {"secrets": {"a": {"b": 1}}}}, "secrets.a"),
        ({"name": "a", "templates": {1: "x"}}, "templates.1"),
        ({"name": "a", "clients": [{"a": 1}]}, "clients.0"),
        ({"name": "a", "modelProvider": {"a": 1}}, "modelProvider"),
        (
            {"name": "a", "messageExamples": [[{"name": "x", "content": {"text": "y", "actions": [[1]]}}]]},
            "actions.0",
        ),
    ],
)
def test_odd_documents_are_refused_with_the_place_never_a_crash(
    document: dict[object, object], where: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        parse_character(document)
    assert where in refused.value.message


def test_a_key_that_is_not_a_string_is_kept_as_one() -> None:
    character = parse_character({"name": "a", 1: 2})
    assert character.extra == {"1": 2}
    assert any(w.endswith("kept in the stored character: 1") for w in character.warnings)
