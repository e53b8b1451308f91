"""MCP servers' tools as an agent's actions (docs/mcp.md): ``..mcp_servers`` parses the character's
``mcpServers``, ``connection`` holds one session per server per replica (a plugin service,
restarted with backoff), ``registry`` keeps each agent's ``mcp`` plugin in step with its servers'
tool lists, ``api`` serves ``parley.v1.Mcp``."""
