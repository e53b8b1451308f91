"""REFLECTION's fields as a model writes them: JSON arrays, one item per line, or an array cut short
when the model ran out of tokens (seen from the local model of `make run`)."""

from __future__ import annotations

from parley_runtime.plugins.reflection import _json_list


def test_a_json_array_is_read_as_it_is() -> None:
    assert _json_list('["Ana lives in Lisbon", "Ana paints boats"]') == [
        "Ana lives in Lisbon",
        "Ana paints boats",
    ]
    assert _json_list("") == []
    assert _json_list('{"facts": ["not a list"]}') == []


def test_an_array_cut_short_keeps_its_whole_items_only() -> None:
    cut = '["Ana lives in Lisbon", "Lisbon is the capital of Portugal", "Boats are a popular subject in'
    assert _json_list(cut) == ["Ana lives in Lisbon", "Lisbon is the capital of Portugal"]
    relationships = '[{"source": "Ana", "target": "Tom", "tags": ["siblings"]}, {"source": "Ana", "tar'
    assert _json_list(relationships) == [{"source": "Ana", "target": "Tom", "tags": ["siblings"]}]
    assert _json_list('  [\n  "one",\n  "two",\n') == ["one", "two"]
    assert _json_list('["cut') == []


def test_one_item_per_line_is_still_read() -> None:
    assert _json_list("- Ana lives in Lisbon\n• Ana paints boats\n\n") == [
        "Ana lives in Lisbon",
        "Ana paints boats",
    ]
