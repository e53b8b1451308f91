"""elizaOS character files as they are: the 0.x, 1.x and current shapes, brought to Parley's.

``normalize`` takes the document a user wrote and returns the one ``Character`` validates, with
the warnings worth telling them: elizaOS plugins with no Parley equivalent, templates no Parley
prompt uses, keys Parley does not know (kept in ``extra``, never fatal). It is idempotent: the
stored (normalized) document passes through unchanged, so every replica reloads the same agent.
"""

from __future__ import annotations

from typing import Any

# elizaOS plugins → the Parley plugin that does their job, or None when the suite itself does it.
PLUGIN_EQUIVALENTS: dict[str, str | None] = {
    "@elizaos/plugin-bootstrap": None,  # basic_capabilities: every agent has it
    "@elizaos/plugin-sql": None,  # the runtime's PostgreSQL store
    "@elizaos/plugin-knowledge": None,  # the documents package and the KNOWLEDGE provider
    "@elizaos/plugin-openai": None,  # model providers: the model gateway's configuration
    "@elizaos/plugin-anthropic": None,
    "@elizaos/plugin-ollama": None,
    "@elizaos/plugin-openrouter": None,
    "@elizaos/plugin-google-genai": None,
    "@elizaos/plugin-groq": None,
    "@elizaos/plugin-local-ai": None,
    "@elizaos/plugin-local-embedding": None,
}
# The names each Parley prompt answers to in ``templates`` (elizaOS's template keys).
TEMPLATE_USES = {
    "messageHandlerTemplate": "the planner prompt of every message turn",
    "shouldRespondTemplate": "the should-respond decision",
    "reflectionTemplate": "the REFLECTION evaluator",
}
KNOWN_KEYS = frozenset(
    {
        "name",
        "id",
        "username",
        "system",
        "bio",
        "lore",
        "style",
        "topics",
        "adjectives",
        "messageExamples",
        "postExamples",
        "knowledge",
        "settings",
        "secrets",
        "plugins",
        "templates",
        "clients",
        "modelProvider",
        "customActions",
        "mcpServers",
        "enabled",
        "extra",
        "elizaPlugins",
    }
)


def _strings(value: Any) -> Any:
    """A string or a list of strings as a list; anything else as it is (validation explains it)."""
    if isinstance(value, str):
        return [value] if value.strip() else []
    return value


def _example_message(message: Any) -> Any:
    """``{"user"|"name", "content": {"text", "action"|"actions"}}`` as ``{"name", "text", "actions"}``."""
    if not isinstance(message, dict) or "content" not in message:
        return message
    content = message["content"] if isinstance(message["content"], dict) else {"text": message["content"]}
    actions = content.get("actions") or content.get("action") or []
    out: dict[str, Any] = {
        "name": message.get("name", message.get("user", "")),
        "text": content.get("text", ""),
    }
    if actions:
        out["actions"] = _strings(actions)
    return out


def _message_examples(value: Any) -> Any:
    """Every shape: ``[[msg, ..]]`` (0.x ``user``, 1.x ``name``) and ``[{"examples": [msg, ..]}]``."""
    if not isinstance(value, list):
        return value
    groups = []
    for group in value:
        if isinstance(group, dict) and "examples" in group:
            group = group["examples"]
        groups.append([_example_message(m) for m in group] if isinstance(group, list) else group)
    return groups


def _knowledge(value: Any, warnings: list[str]) -> Any:
    """Strings and inlined files (``{"path", "text"}``) become documents; an unread path is reported."""
    if not isinstance(value, list):
        return value
    items = []
    for item in value:
        if isinstance(item, str):
            if item.strip():
                items.append({"text": item})
        elif isinstance(item, dict) and "text" not in item and ({"path", "directory"} & item.keys()):
            where = item.get("path", item.get("directory"))
            warnings.append(
                f"knowledge {where!r} was not read: file entries are read by `parley agents add` "
                "or from the runtime's characters directory, never from an API request"
            )
        else:
            items.append(item)
    return items


def _plugins(data: dict[str, Any], warnings: list[str]) -> None:
    plugins = data.get("plugins")
    if not isinstance(plugins, list):
        return
    kept: list[Any] = []
    written = data.get("elizaPlugins")
    eliza = [p for p in written if isinstance(p, str)] if isinstance(written, list) else []
    missing = []
    for name in plugins:
        if not isinstance(name, str) or not name.startswith("@"):
            kept.append(name)
            continue
        eliza.append(name)
        if name in PLUGIN_EQUIVALENTS:
            equivalent = PLUGIN_EQUIVALENTS[name]
            if equivalent is not None and equivalent not in kept:
                kept.append(equivalent)
        else:
            missing.append(name)
    data["plugins"] = kept
    if eliza:
        data["elizaPlugins"] = list(dict.fromkeys(eliza))
    if missing:
        warnings.append(
            "elizaOS plugins with no Parley equivalent, not loaded (their actions, providers and "
            f"services are missing): {', '.join(missing)}"
        )


def normalize(document: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The document in Parley's shape, and the warnings; validation errors are left to Character."""
    data = dict(document)
    warnings: list[str] = []
    for key in ("bio", "lore", "topics", "adjectives", "postExamples", "clients"):
        if key in data:
            data[key] = _strings(data[key])
    if isinstance(data.get("style"), dict):
        data["style"] = {k: _strings(v) for k, v in data["style"].items()}
    if "messageExamples" in data:
        data["messageExamples"] = _message_examples(data["messageExamples"])
    if "knowledge" in data:
        data["knowledge"] = _knowledge(data["knowledge"], warnings)
    settings = data.get("settings")
    if isinstance(settings, dict) and isinstance(settings.get("secrets"), dict):
        # elizaOS keeps secrets in settings.secrets too: stored encrypted with the others (a
        # top-level secret of the same name wins, as get_setting would have it).
        data["settings"] = {k: v for k, v in settings.items() if k != "secrets"}
        top = data.get("secrets")
        data["secrets"] = {**settings["secrets"], **(top if isinstance(top, dict) else {})}
    if isinstance(data.get("secrets"), dict):
        data["secrets"] = {
            k: str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, (int, float)) else v
            for k, v in data["secrets"].items()
        }
    _plugins(data, warnings)
    templates = data.get("templates")
    if isinstance(templates, dict):
        unused = sorted(str(k) for k in templates if k not in TEMPLATE_USES)
        if unused:
            warnings.append(
                f"templates no Parley prompt uses, kept: {', '.join(unused)} "
                f"(used: {', '.join(TEMPLATE_USES)})"
            )
    clients = data.get("clients")
    if isinstance(clients, list) and clients:
        warnings.append(
            f"clients {', '.join(map(str, clients))}: Parley's connectors serve them; register each with "
            "`parley connectors add --source NAME` (kept for reference)"
        )
    if data.get("modelProvider"):
        warnings.append(
            f"modelProvider {data['modelProvider']!r} is kept for reference: the model gateway's "
            "configuration chooses the provider"
        )
    unknown = {str(k): v for k, v in data.items() if k not in KNOWN_KEYS}
    if unknown:
        data = {k: v for k, v in data.items() if k in KNOWN_KEYS}
        extra = data.get("extra")
        data["extra"] = {**(extra if isinstance(extra, dict) else {}), **unknown}
        names = ", ".join(sorted(unknown))
        warnings.append(f"keys Parley does not use, kept in the stored character: {names}")
    return data, warnings
