"""The connector kit: bring a chat platform to Parley's agents (docs/connectors.md).

from parley_connectors import Connector, Credentials, Inbound

async with await Connector.connect(Credentials.load("telegram.json")) as conn:
    await conn.send(Inbound(message_id="42", sender_id="u1", text="hi"))
    async for reply in conn.replies():
        print(reply.text)
        await reply.ack()
"""

from .connector import Cancelled, Chunks, Connector
from .credentials import Credentials
from .messages import Attachment, Chunk, Inbound, Reply, RoomType

__all__ = [
    "Attachment",
    "Cancelled",
    "Chunk",
    "Chunks",
    "Connector",
    "Credentials",
    "Inbound",
    "Reply",
    "RoomType",
]
