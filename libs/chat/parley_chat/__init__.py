"""Chat platforms' connectors (Telegram, Slack): one platform message per reply, streamed by
editing it, finished from the durable reply (``delivery``); the connector process around the
connector kit (``bridge``)."""
