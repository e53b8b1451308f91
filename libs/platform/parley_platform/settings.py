"""Settings shared by every service, read from ``PARLEY_*`` environment variables."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Environment(StrEnum):
    DEVELOPMENT = "development"
    TEST = "test"
    PRODUCTION = "production"


class Settings(BaseSettings):
    """Common settings. Services subclass this to add their own."""

    model_config = SettingsConfigDict(env_prefix="PARLEY_", extra="ignore")

    environment: Environment = Environment.DEVELOPMENT
    # One URL, or several separated by commas (the servers of a cluster).
    nats_url: str = "nats://127.0.0.1:4222"
    # This process's NATS identity (see parley_platform.permissions); nothing connects anonymously.
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    # TLS to NATS: the CA that signed the server's certificate, and a client certificate and key
    # when the server asks for one (tls:// URLs, or any URL once a CA is set).
    nats_tls_ca: Path | None = None
    nats_tls_cert: Path | None = None
    nats_tls_key: Path | None = None
    # Copies of every stream the suite creates (1 on one server; 3 on a three-node cluster). A
    # running stream with another count is updated to this one at start-up.
    stream_replicas: int = Field(default=1, ge=1, le=5)
    database_url: str = "postgresql://parley@127.0.0.1:5432/parley"
    # Prefix of every subject and stream name. Test sessions use their own so
    # runs sharing one NATS server never collide.
    namespace: str = Field(default="parley", pattern=r"^[a-z][a-z0-9_]{0,31}$")
    operator_token: SecretStr | None = None
    # TLS for the gRPC server (both files, or neither: plaintext on the bound address).
    grpc_tls_cert: Path | None = None
    grpc_tls_key: Path | None = None
    log_level: str = "INFO"
    log_format: str = Field(default="text", pattern=r"^(text|json)$")
    metrics_host: str = "127.0.0.1"
    grpc_host: str = "127.0.0.1"
    db_pool_min: int = Field(default=2, ge=1)
    db_pool_max: int = Field(default=10, ge=1)
    shutdown_timeout_seconds: float = Field(default=10.0, gt=0)
    state_dir: Path = Path(".parley")

    @field_validator("nats_url", "database_url")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value.strip()

    @model_validator(mode="after")
    def _tls_files(self) -> Settings:
        if (self.grpc_tls_cert is None) != (self.grpc_tls_key is None):
            raise ValueError("PARLEY_GRPC_TLS_CERT and PARLEY_GRPC_TLS_KEY go together")
        for name in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key", "grpc_tls_cert", "grpc_tls_key"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"PARLEY_{name.upper()}: no file at {path}")
        return self
