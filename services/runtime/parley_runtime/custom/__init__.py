"""Custom actions: operator-defined actions with an ``http``, ``shell`` or ``code`` handler.

``definitions`` validates them, ``ssrf`` guards the http handler, ``http``/``shell``/``code`` run
them, ``registry`` turns them into ordinary actions of each agent's catalog and keeps every replica
in step with the database, ``api`` serves ``parley.v1.CustomActions``.
"""
