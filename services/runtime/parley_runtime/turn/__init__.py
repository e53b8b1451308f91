"""Agent turns.

A message turn (``processor.py``): decode → ingest (the room's lease) → the stages of
``stages/`` in order - gate, should_respond, compose, plan, act, confirm, deliver, after_reply -
run by ``pipeline.Pipeline``, which times each one and stops early when one decides the turn.
The stages talk to the world through ``ports`` (model, outbox, inbox, events, authz, pairing);
handlers see a ``TurnContext`` (``services.py``). Approved actions and confirmed conversations
have their own entry point (``confirmations.py``).
"""
