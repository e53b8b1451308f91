"""The pairing service: who may talk to an agent through a connector (pending requests, allowlists)."""
