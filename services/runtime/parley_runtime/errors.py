"""The runtime's error codes: agents and characters, plugins, custom actions, documents, secrets,
and the operator API."""

from __future__ import annotations

from parley_platform.errors import Catalog, Kind

CATALOG = Catalog("runtime", "The runtime: agents, turns, plugins, custom actions, documents.")
define = CATALOG.define

# Agents, characters and plugins
NO_CHARACTERS = define(
    "NO_CHARACTERS",
    Kind.INVALID_ARGUMENT,
    "The characters directory holds no character file; the runtime refuses to start.",
    hint="add a YAML character, e.g. characters/default.yaml",
)
AGENT_REQUIRED = define(
    "AGENT_REQUIRED", Kind.INVALID_ARGUMENT, "The request names no agent (an agent id or name is required)."
)
AGENT_NOT_FOUND = define(
    "AGENT_NOT_FOUND", Kind.NOT_FOUND, "No agent has this id or name.", hint="list them with `parley agents`"
)
CHARACTER_REQUIRED = define(
    "CHARACTER_REQUIRED", Kind.INVALID_ARGUMENT, "UpsertAgent was sent without a character document."
)
CHARACTER_TOO_LARGE = define(
    "CHARACTER_TOO_LARGE", Kind.INVALID_ARGUMENT, "The character document is over 1 MB."
)
CHARACTER_INVALID = define(
    "CHARACTER_INVALID",
    Kind.INVALID_ARGUMENT,
    "A character document does not parse or does not validate; the message names the field.",
)
PLUGIN_INVALID = define(
    "PLUGIN_INVALID",
    Kind.INVALID_ARGUMENT,
    "A plugin is malformed (a bad action name, parameter schema, tag, role, or a part of the wrong type).",
)
PLUGIN_NOT_FOUND = define(
    "PLUGIN_NOT_FOUND",
    Kind.INVALID_ARGUMENT,
    "A character names a plugin that is neither built in, nor installed, nor an importable path.",
)
PLUGIN_CONFLICT = define(
    "PLUGIN_CONFLICT", Kind.INVALID_ARGUMENT, "Two plugins of one agent define an action of the same name."
)
PLUGIN_CONFIG_INVALID = define(
    "PLUGIN_CONFIG_INVALID",
    Kind.INVALID_ARGUMENT,
    "A setting a plugin declares is missing (required) or does not match its schema for this agent.",
    hint="set it in the character's settings or secrets (the message names the plugin and setting)",
)
UNKNOWN_SUBACTION = define(
    "UNKNOWN_SUBACTION",
    Kind.INVALID_ARGUMENT,
    "The planner named no sub-action, or one the action does not have.",
)
TRAJECTORY_LOGGING_INVALID = define(
    "TRAJECTORY_LOGGING_INVALID",
    Kind.INVALID_ARGUMENT,
    "PARLEY_TRAJECTORY_LOGGING is not a boolean; the runtime refuses to start rather than guess.",
)

# Secrets
SECRET_SALT_EMPTY = define(
    "SECRET_SALT_EMPTY",
    Kind.INVALID_ARGUMENT,
    "The key for agents' secrets would be derived from an empty salt.",
    hint="pass the result of check_salt()",
)
DEFAULT_SECRET_SALT = define(
    "DEFAULT_SECRET_SALT",
    Kind.FAILED_PRECONDITION,
    "Production with the built-in secret salt: anyone could decrypt the stored secrets.",
    hint="set PARLEY_SECRET_SALT to a long random value (python -c 'import secrets; "
    "print(secrets.token_urlsafe(32))'), or PARLEY_ALLOW_DEFAULT_SECRET_SALT=true to accept the risk",
)
SECRET_DECRYPT_FAILED = define(
    "SECRET_DECRYPT_FAILED",
    Kind.FAILED_PRECONDITION,
    "A stored secret cannot be decrypted with this deployment's key under its name.",
)

# The operator API
TEXT_REQUIRED = define("TEXT_REQUIRED", Kind.INVALID_ARGUMENT, "SendMessage was sent without text.")
INVALID_TIMEOUT = define("INVALID_TIMEOUT", Kind.INVALID_ARGUMENT, "timeout_seconds is outside 0-600.")
REPLY_TIMEOUT = define(
    "REPLY_TIMEOUT",
    Kind.DEADLINE_EXCEEDED,
    "SendMessage waited its whole timeout without a reply from the agent.",
    hint="the message was accepted; the reply may still come",
)
INVALID_TABLE = define(
    "INVALID_TABLE", Kind.INVALID_ARGUMENT, "A memory table is not one of the runtime's memory kinds."
)
INVALID_LIMIT = define("INVALID_LIMIT", Kind.INVALID_ARGUMENT, "A search limit is out of its range.")
QUERY_REQUIRED = define("QUERY_REQUIRED", Kind.INVALID_ARGUMENT, "A search was sent without a query.")
TURN_NOT_FOUND = define("TURN_NOT_FOUND", Kind.NOT_FOUND, "The agent has no turn with this id.")
ROOM_NOT_FOUND = define("ROOM_NOT_FOUND", Kind.NOT_FOUND, "The agent has no room with this id.")
WORLD_NOT_FOUND = define("WORLD_NOT_FOUND", Kind.NOT_FOUND, "The agent has no world with this id.")
PARTICIPANT_NOT_FOUND = define(
    "PARTICIPANT_NOT_FOUND",
    Kind.NOT_FOUND,
    "SetParticipantRole named a room or an entity the agent does not have.",
    hint="list them with `parley rooms list --agent A` and `parley entities list --agent A`",
)
INVALID_ROLE = define(
    "INVALID_ROLE", Kind.INVALID_ARGUMENT, "A role is not one of OWNER, ADMIN, MEMBER, GUEST or NONE."
)
MUTE_TARGET_INVALID = define(
    "MUTE_TARGET_INVALID",
    Kind.INVALID_ARGUMENT,
    "SetMute must name exactly one of room_id and world_id.",
)
MUTE_TIME_INVALID = define(
    "MUTE_TIME_INVALID",
    Kind.INVALID_ARGUMENT,
    "A mute's time is wrong: until in the past, a duration not above zero or over a year, both given, "
    "or a time given to an unmute.",
)
CAPABILITY_NOT_CONFIGURED = define(
    "CAPABILITY_NOT_CONFIGURED",
    Kind.FAILED_PRECONDITION,
    "An action that needs a capability authorization has no account or snapshot configured for the agent.",
    hint="set the settings the message names in the character (see docs/plugins.md, capabilities)",
)

# Custom actions
CUSTOM_ACTION_INVALID = define(
    "CUSTOM_ACTION_INVALID",
    Kind.INVALID_ARGUMENT,
    "A custom action definition does not validate; the message names the field, never a value.",
)
CUSTOM_ACTION_NAME_TAKEN = define(
    "CUSTOM_ACTION_NAME_TAKEN",
    Kind.INVALID_ARGUMENT,
    "The name or id is taken by a plugin action, or by a definition of the character or the config file.",
    hint="remove that one first, or add this one under the other's id to replace it",
)
CUSTOM_ACTION_HANDLER_DISABLED = define(
    "CUSTOM_ACTION_HANDLER_DISABLED",
    Kind.FAILED_PRECONDITION,
    "Shell and code handlers are off on this runtime unless the operator enables them.",
)
CUSTOM_ACTION_NOT_FOUND = define(
    "CUSTOM_ACTION_NOT_FOUND",
    Kind.NOT_FOUND,
    "The agent has no custom action registered through the API with this id.",
    hint="list them with `parley actions list`",
)
DEFINITION_REQUIRED = define(
    "DEFINITION_REQUIRED", Kind.INVALID_ARGUMENT, "TestCustomAction was sent neither a definition nor an id."
)
DEFINITION_OR_ID = define(
    "DEFINITION_OR_ID", Kind.INVALID_ARGUMENT, "TestCustomAction was sent both a definition and an id."
)
DEFINITION_TOO_LARGE = define(
    "DEFINITION_TOO_LARGE", Kind.INVALID_ARGUMENT, "A custom action definition is over 256 kB."
)
ID_REQUIRED = define("ID_REQUIRED", Kind.INVALID_ARGUMENT, "The request names no custom action id.")
PARAMS_INVALID = define("PARAMS_INVALID", Kind.INVALID_ARGUMENT, "params_json is not a JSON object.")
PARAMS_TOO_LARGE = define("PARAMS_TOO_LARGE", Kind.INVALID_ARGUMENT, "params_json is over 256 kB.")
SSRF_BLOCKED = define(
    "SSRF_BLOCKED",
    Kind.INVALID_ARGUMENT,
    "An http action's URL names or resolves to an address the runtime does not fetch (loopback, private,"
    " link-local, metadata, ...).",
    hint="PARLEY_CUSTOM_ACTIONS_ALLOW_HOSTS lets names, addresses or CIDRs through",
)

# Documents
INVALID_REQUESTER = define(
    "INVALID_REQUESTER", Kind.INVALID_ARGUMENT, "A requester is both the operator and an entity."
)
REQUESTER_REQUIRED = define(
    "REQUESTER_REQUIRED",
    Kind.INVALID_ARGUMENT,
    "A document request names no requester, so no read or change rule could apply.",
    hint="name the entity the request is made for, so its read and change rules apply",
)
INVALID_SCOPE = define("INVALID_SCOPE", Kind.INVALID_ARGUMENT, "The scope is not a DocumentScope.")
INVALID_SCOPED_ENTITY = define(
    "INVALID_SCOPED_ENTITY",
    Kind.INVALID_ARGUMENT,
    "scoped_to_entity_id is given for a document that is not user-private, or missing for one that is.",
)
TOO_MANY_GRANTS = define("TOO_MANY_GRANTS", Kind.INVALID_ARGUMENT, "More than 1000 direct grants.")
DUPLICATE_GRANTS = define("DUPLICATE_GRANTS", Kind.INVALID_ARGUMENT, "A direct grant is listed twice.")
UNKNOWN_ENTITY = define(
    "UNKNOWN_ENTITY", Kind.INVALID_ARGUMENT, "A scoped or granted entity is not an entity of this agent."
)
TITLE_TOO_LONG = define("TITLE_TOO_LONG", Kind.INVALID_ARGUMENT, "A document title is over 500 characters.")
DOCUMENT_CONTENT_REQUIRED = define(
    "DOCUMENT_CONTENT_REQUIRED", Kind.INVALID_ARGUMENT, "A document needs exactly one of text and content."
)
UNSUPPORTED_CONTENT_TYPE = define(
    "UNSUPPORTED_CONTENT_TYPE",
    Kind.INVALID_ARGUMENT,
    "The content type is not text, Markdown or PDF (or a PDF was sent as text).",
    hint="use text/plain, text/markdown or application/pdf (or a .txt, .md or .pdf file name)",
)
DOCUMENT_TOO_LARGE = define(
    "DOCUMENT_TOO_LARGE", Kind.INVALID_ARGUMENT, "A document's file or text is over the size limit."
)
DOCUMENT_NOT_UTF8 = define(
    "DOCUMENT_NOT_UTF8", Kind.INVALID_ARGUMENT, "A text file is not UTF-8.", hint="convert it to UTF-8"
)
DOCUMENT_EMPTY = define("DOCUMENT_EMPTY", Kind.INVALID_ARGUMENT, "A document has no text.")
PDF_ENCRYPTED = define(
    "PDF_ENCRYPTED", Kind.INVALID_ARGUMENT, "The PDF is encrypted.", hint="add a decrypted copy"
)
PDF_TOO_LARGE = define("PDF_TOO_LARGE", Kind.INVALID_ARGUMENT, "The PDF has over 2000 pages.")
PDF_UNREADABLE = define("PDF_UNREADABLE", Kind.INVALID_ARGUMENT, "The file is not a PDF pypdf can read.")
DOCUMENT_ADD_DENIED = define(
    "DOCUMENT_ADD_DENIED",
    Kind.PERMISSION_DENIED,
    "The requester may not add a document with this scope, room and grants.",
    hint="members add user-private documents of their own rooms; the operator adds any",
)
DOCUMENT_ADD_RACED = define(
    "DOCUMENT_ADD_RACED",
    Kind.CONFLICT,
    "The room or a granted entity changed between the check and the write; retrying may succeed.",
    retryable=True,
)
DOCUMENT_NOT_FOUND = define(
    "DOCUMENT_NOT_FOUND",
    Kind.NOT_FOUND,
    "No document with this id that the requester may read (an unreadable one looks missing).",
    hint="list the documents you may read with `parley docs list`",
)
DOCUMENT_CHANGE_DENIED = define(
    "DOCUMENT_CHANGE_DENIED",
    Kind.PERMISSION_DENIED,
    "The requester may read the document but not remove it.",
    hint="grants give reading only; ask an OWNER",
)
DOCUMENT_GRANT_DENIED = define(
    "DOCUMENT_GRANT_DENIED",
    Kind.PERMISSION_DENIED,
    "The requester may read the document but not replace its grants.",
    hint="the OWNER may; an ADMIN of the document's room may for global and user-private ones",
)
REVISION_REQUIRED = define(
    "REVISION_REQUIRED",
    Kind.INVALID_ARGUMENT,
    "A grant replacement was sent without the access revision it expects.",
    hint="read it with GetDocument (`parley docs show`)",
)
ACCESS_REVISION_CHANGED = define(
    "ACCESS_REVISION_CHANGED",
    Kind.CONFLICT,
    "The document's grants changed since the expected access revision; the message names the current one.",
    hint="read the document again and retry with its access_revision",
)

# Turn cancellation
INVALID_CANCEL = define(
    "INVALID_CANCEL",
    Kind.INVALID_ARGUMENT,
    "A CancelTurn request does not name a turn: it needs an agent id and a turn id, or the message id "
    "of the message that started the turn with its source.",
)

# MCP servers (parley_runtime/mcp, docs/mcp.md)
MCP_SERVER_INVALID = define(
    "MCP_SERVER_INVALID",
    Kind.INVALID_ARGUMENT,
    "An MCP server definition is malformed (its name, or not exactly one of command and url); the "
    "message names the field.",
)
MCP_SERVER_NOT_FOUND = define(
    "MCP_SERVER_NOT_FOUND",
    Kind.NOT_FOUND,
    "The agent names no MCP server of this name.",
    hint="list them with `parley mcp list AGENT`",
)
MCP_STDIO_DISABLED = define(
    "MCP_STDIO_DISABLED",
    Kind.FAILED_PRECONDITION,
    "Stdio MCP servers run programs on the runtime's host; they are off unless the operator enables them.",
    hint="set PARLEY_MCP_STDIO=true on the runtime",
)
MCP_SECRET_MISSING = define(
    "MCP_SECRET_MISSING",
    Kind.FAILED_PRECONDITION,
    "An MCP server's header or env value refers to a secret ({{secret:NAME}}) the agent does not have.",
)
MCP_UNAVAILABLE = define(
    "MCP_UNAVAILABLE",
    Kind.UNAVAILABLE,
    "The MCP server is not connected (starting, or restarting after it died); the message says why.",
)
