"""The Slack connector: the Events API over HTTP with slack-bolt (signatures verified, retries
deduplicated), replies with slack-sdk's Web API client, streamed by ``chat.update``
(docs/connectors.md, "Telegram and Slack")."""
