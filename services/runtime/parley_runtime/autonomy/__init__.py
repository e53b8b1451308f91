"""Autonomy: the agent thinking and acting on its own, on a schedule, with no message to answer.

The model gateway's prompt batcher holds what to ask (one recurring ``think`` section per agent);
the scheduler's BATCHER_DRAIN task of the ``autonomy`` affinity decides when; each result becomes
an autonomous turn on the runtime's own subject, which runs the post-model stages of a message
turn (actions, private ones included, memory, evaluators) in the agent's autonomy room.
"""
