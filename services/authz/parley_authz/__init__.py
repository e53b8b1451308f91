"""The authz service: tool-call decisions, one-shot capability authorization, interaction leases
and interaction confirmations."""
