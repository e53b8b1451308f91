"""The plugin SDK: everything a plugin imports from Parley.

A plugin is a ``Plugin`` of actions, providers, evaluators, services, event handlers and
declared settings (with ``init``), loaded after the plugins it depends on. Handlers get a
``TurnContext``: the message, the room, the sender's role, what the providers found, the results
of earlier actions, and ``ctx.services`` for what they may ask of the runtime (memories,
documents, the model, settings). They never see protobuf, SQL or NATS.
"""

from ._context import (
    HistoryLine,
    KnowledgeHit,
    MemoryHit,
    MessageView,
    NewMemory,
    Participant,
    PendingCall,
    RuntimeServices,
    State,
    TurnContext,
)
from ._plugin import (
    Action,
    ActionHandler,
    ActionResult,
    Callback,
    Capability,
    Content,
    Evaluator,
    EvaluatorPrompt,
    EventHandler,
    EventView,
    Parameter,
    Plugin,
    Provider,
    ProviderResult,
    Service,
    ServiceRun,
    Setting,
    Tag,
    Validator,
)
from ._subactions import SUBACTION_KEYS, UnknownSubaction, dispatch_subaction, normalise_subaction

__all__ = [
    "SUBACTION_KEYS",
    "Action",
    "ActionHandler",
    "ActionResult",
    "Callback",
    "Capability",
    "Content",
    "Evaluator",
    "EvaluatorPrompt",
    "EventHandler",
    "EventView",
    "HistoryLine",
    "KnowledgeHit",
    "MemoryHit",
    "MessageView",
    "NewMemory",
    "Parameter",
    "Participant",
    "PendingCall",
    "Plugin",
    "Provider",
    "ProviderResult",
    "RuntimeServices",
    "Service",
    "ServiceRun",
    "Setting",
    "State",
    "Tag",
    "TurnContext",
    "UnknownSubaction",
    "Validator",
    "dispatch_subaction",
    "normalise_subaction",
]
