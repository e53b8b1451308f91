from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr

from parley_platform.settings import Settings


class RuntimeSettings(Settings):
    runtime_grpc_port: int = Field(default=50051, ge=0, le=65535)
    runtime_metrics_port: int = Field(default=9101, ge=0, le=65535)
    characters_dir: Path = Path("characters")
    max_text_bytes: int = Field(default=64 * 1024, gt=0)
    turn_concurrency: int = Field(default=64, gt=0)
    max_deliver: int = Field(default=5, gt=1)
    ack_wait_seconds: float = Field(default=60.0, gt=0)
    model_timeout_seconds: float = Field(default=30.0, gt=0)
    # Deadlines of the calls to authz (confirmations) and to pairing (the DM gate, which fails
    # closed when pairing does not answer in time).
    authz_timeout_seconds: float = Field(default=30.0, gt=0)
    pairing_timeout_seconds: float = Field(default=2.0, gt=0)
    recent_messages: int = Field(default=10, ge=0, le=100)
    provider_timeout_seconds: float = Field(default=5.0, gt=0)
    # Store an embedding of every message (after the reply, through the model gateway).
    embed_messages: bool = True
    # How long the message embeddings of the turns finishing together gather before they are
    # computed in one call and stored in one statement (0: only what arrives meanwhile).
    embedding_batch_window_ms: int = Field(default=50, ge=0, le=10_000)
    # The evaluators of a turn that have prompt segments share one call through the model gateway's
    # prompt batcher; false: each evaluator makes its own model call.
    evaluator_batching: bool = True
    # How long a turn's evaluator sections wait for a drain that packs them with other turns' of the
    # room before the turn drains them itself (0: at once).
    evaluator_batch_window_ms: int = Field(default=1000, ge=0, le=30_000)
    # Truthy enables, a non-empty falsy value disables, blank counts as unset; unset means on in
    # development and off under test and production.
    trajectory_logging: str | None = None
    secret_salt: SecretStr | None = None
    allow_default_secret_salt: bool = False
    # Custom actions (parley_runtime/custom): a YAML/JSON file of definitions for every agent, and
    # the operator's switches. Shell and code handlers run on this host, so they stay off unless
    # enabled here; the http handler reaches public addresses only, except the hosts (names,
    # addresses or CIDR networks, comma-separated) allowed here.
    custom_actions_file: Path | None = None
    custom_actions_shell: bool = False
    custom_actions_code: bool = False
    custom_actions_allow_hosts: str = ""
    # MCP servers' tools as actions (parley_runtime/mcp, docs/mcp.md). Stdio servers run programs on
    # this host, so they stay off unless enabled; streamable HTTP servers pass the http custom
    # actions' SSRF guard, except the hosts allowed here (names, addresses or CIDR networks).
    # Tools with destructiveHint wait for a person's confirmation unless this is false.
    mcp_stdio: bool = False
    mcp_allow_hosts: str = ""
    mcp_confirm_destructive: bool = True
    mcp_call_timeout_seconds: float = Field(default=30.0, gt=0, le=600)
    # The authz lease of a singleton plugin service: the replica holding it runs the service and
    # renews it every third of this; when that replica dies another takes over within this time.
    plugin_service_lease_ms: int = Field(default=10_000, ge=1_000, le=60_000)
    # Autonomy (parley_runtime/autonomy), for agents whose character does not set them: the think
    # interval (clamped to 5,000-600,000 ms; malformed or unset is 30,000) and the model size
    # (small or large; anything else is large). Read as given: the autonomy policy validates them.
    autonomy_interval_ms: str | None = Field(
        default=None, validation_alias=AliasChoices("AUTONOMY_INTERVAL_MS", "PARLEY_AUTONOMY_INTERVAL_MS")
    )
    autonomy_model_size: str | None = Field(
        default=None, validation_alias=AliasChoices("AUTONOMY_MODEL_SIZE", "PARLEY_AUTONOMY_MODEL_SIZE")
    )
