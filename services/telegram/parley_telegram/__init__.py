"""The Telegram connector: python-telegram-bot's Bot API client, long polling, replies streamed by
editing one message (docs/connectors.md, "Telegram and Slack")."""
