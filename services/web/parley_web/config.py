from __future__ import annotations

from pydantic import Field

from parley_platform.settings import Settings


class WebSettings(Settings):
    # The HTTP server: the chat page and /v1 (loopback unless told otherwise: put a TLS proxy in front
    # of it before exposing it).
    web_host: str = "127.0.0.1"
    web_port: int = Field(default=8080, ge=0, le=65535)
    # gRPC serves only health here; metrics as every service.
    web_grpc_port: int = Field(default=50056, ge=0, le=65535)
    web_metrics_port: int = Field(default=9106, ge=0, le=65535)
    # How long a request waits for the agent's reply before answering 504.
    web_reply_timeout_seconds: float = Field(default=120.0, gt=0, le=3600)
    # How long a checked API key (and the agents' names) is trusted before asking again: a revoked
    # key stops working within this time.
    web_cache_seconds: float = Field(default=10.0, ge=0, le=3600)
    # Calls to the pairing service and the runtime.
    web_rpc_timeout_seconds: float = Field(default=5.0, gt=0, le=60)
    # Messages of the history the page shows on load.
    web_history_limit: int = Field(default=100, ge=1, le=100)
    # The longest user message accepted, in characters.
    web_max_message_chars: int = Field(default=32_000, ge=1, le=1_000_000)
