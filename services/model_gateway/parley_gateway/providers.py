"""The providers the settings name, each built once, and the protection put around each."""

from __future__ import annotations

from pydantic import SecretStr

from .api import MODEL_TYPES
from .config import GatewaySettings
from .engine import Protected
from .local import LocalEmbedder, LocalProvider
from .protection import CircuitBreaker, Limiter
from .provider import Embedder, Provider
from .remote import AnthropicProvider, ModelNames, OpenAIEmbedder, OpenAIProvider
from .scripted import ScriptedEmbedder, ScriptedProvider, load_rules


def _secret(value: SecretStr | None) -> str:
    return value.get_secret_value() if value is not None else ""


def build_providers(settings: GatewaySettings) -> tuple[dict[str, Provider], Embedder]:
    """One provider object per name, shared by the model types routed to it, and the embedder."""
    wanted = {
        model_type: getattr(settings, f"model_provider_{model_type.lower()}") or settings.model_provider
        for model_type in MODEL_TYPES.values()
    }
    embedding = settings.embedding_provider or (
        "scripted" if settings.model_provider == "scripted" else "local"
    )
    made: dict[str, Provider] = {}
    names = set(wanted.values()) | ({"openai"} if embedding == "openai" else set())
    for name in sorted(names):
        if name == "scripted":
            rules = load_rules(settings.scripted_rules) if settings.scripted_rules else []
            made[name] = ScriptedProvider(rules=rules, latency_ms=settings.scripted_latency_ms)
        elif name == "local":
            made[name] = LocalProvider(
                settings.local_model_path,
                threads=settings.local_threads,
                context_tokens=settings.local_context_tokens,
                temperature=settings.local_temperature,
                prefix_cache=settings.local_prefix_cache_dir,
            )
        elif name == "openai":
            made[name] = OpenAIProvider(
                base_url=settings.openai_base_url,
                api_key=_secret(settings.openai_api_key),
                models=ModelNames(settings.openai_model_small, settings.openai_model_large),
                embedding_model=settings.openai_embedding_model,
                embedding_dimension=settings.openai_embedding_dimension,
            )
        elif name == "anthropic":
            made[name] = AnthropicProvider(
                base_url=settings.anthropic_base_url,
                api_key=_secret(settings.anthropic_api_key),
                models=ModelNames(settings.anthropic_model_small, settings.anthropic_model_large),
            )
    embedder: Embedder
    if embedding == "openai":
        provider = made["openai"]
        assert isinstance(provider, OpenAIProvider)
        embedder = OpenAIEmbedder(provider)
    elif embedding == "local":
        embedder = LocalEmbedder()
    else:
        embedder = ScriptedEmbedder()
    return {model_type: made[name] for model_type, name in wanted.items()}, embedder


def preload(providers: list[Provider], embedder: Embedder) -> None:
    """Load the local models now, so the first request does not pay for it."""
    for thing in [*providers, embedder]:
        if isinstance(thing, LocalProvider | LocalEmbedder):
            thing.load()


def protect(settings: GatewaySettings, provider: Provider) -> Protected:
    """The local model runs one call at a time (one llama.cpp context); HTTP providers share the
    setting; the scripted model has its own, high limit."""
    limit = settings.provider_concurrency
    if isinstance(provider, LocalProvider):
        limit = 1
    elif isinstance(provider, ScriptedProvider):
        limit = settings.scripted_concurrency
    return Protected(
        provider,
        Limiter(provider.name, limit, settings.provider_queue_limit),
        CircuitBreaker(provider.name, settings.circuit_failure_threshold, settings.circuit_reset_seconds),
    )
