"""The KNOWLEDGE provider: fragments of the documents the message's sender may read."""

from __future__ import annotations

from ..sdk import ProviderResult, TurnContext

PROVIDER_FRAGMENTS = 5


async def knowledge(ctx: TurnContext) -> ProviderResult:
    """Fragments of the documents the message's sender may read that relate to the message.

    The search is made as the sender, so the rules of the sender's roles apply in SQL like for any
    requester.
    """
    hits = await ctx.services.search_documents(ctx.message.text, limit=PROVIDER_FRAGMENTS)
    if not hits:
        return ProviderResult()
    lines = [f"- ({h.title}) {' '.join(h.text.split())}" for h in hits]
    return ProviderResult(
        "# Knowledge\n" + "\n".join(lines),
        data={"knowledge": [f"{h.document_id}:{h.position}" for h in hits]},
    )
