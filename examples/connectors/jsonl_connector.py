"""A complete Parley connector: a platform's messages arrive as JSON lines on stdin, the agent's
replies leave as JSON lines on stdout. docs/connectors.md walks through it.

    parley connectors add jsonl --agent default --source jsonl --out jsonl.json
    echo '{"id": "1", "user": "ann", "chat": "c1", "text": "hello"}' | python jsonl_connector.py jsonl.json
"""

import asyncio
import json
import sys

from parley_connectors import Connector, Credentials, Inbound


async def platform_to_parley(conn: Connector) -> None:
    lines = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(lines), sys.stdin)
    while line := await lines.readline():
        event = json.loads(line)
        await conn.send(  # the platform's id: a message delivered twice is answered once
            Inbound(
                message_id=event["id"],
                sender_id=event["user"],
                channel_id=event["chat"],
                text=event["text"],
                room_type="group" if event.get("group") else "dm",
                mentions_agent=event.get("mentioned", False),
                in_reply_to=event.get("reply_to", ""),
            )
        )


async def parley_to_platform(conn: Connector) -> None:
    async for reply in conn.replies():  # replies produced while we were down come first
        print(json.dumps({"chat": reply.channel_id, "reply_to": reply.in_reply_to, "text": reply.text}))
        sys.stdout.flush()
        await reply.ack()  # delivered to the platform: never again


async def main(credentials: str) -> None:
    async with await Connector.connect(Credentials.load(credentials)) as conn:
        await asyncio.gather(platform_to_parley(conn), parley_to_platform(conn))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
