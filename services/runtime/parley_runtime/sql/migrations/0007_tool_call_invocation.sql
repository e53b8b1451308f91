-- A proposed action keeps what it needs of the message that proposed it as typed JSON
-- (records.Invocation) instead of that message's protobuf bytes; rows written before keep
-- their bytes, which the store still reads.
ALTER TABLE runtime.tool_call ADD COLUMN invocation jsonb;
ALTER TABLE runtime.tool_call ALTER COLUMN inbound DROP NOT NULL;
ALTER TABLE runtime.tool_call ADD CONSTRAINT tool_call_invocation
    CHECK (invocation IS NOT NULL OR inbound IS NOT NULL);
