"""The authz service's metrics (spec/authz.md), registered on the app's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PENDING_KINDS = ("tool_call", "capability_decision", "capability_confirmation", "interaction_confirmation")
# From seconds (a person answering a prompt) to a day (an approval left overnight).
DECIDE_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600)


class AuthzMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "parley_authz_decisions",
            "Decisions and authority checks by kind (tool_call, capability, interaction, lease) and outcome",
            ["kind", "outcome"],
            registry=registry,
        )
        self.pending = Gauge(
            "parley_authz_pending",
            "Live items waiting for a decision, confirmation or use, by kind (all agents)",
            ["kind"],
            registry=registry,
        )
        self.pending_age = Gauge(
            "parley_authz_pending_age_seconds",
            "Age of the oldest live pending item by kind; kind=tool_call is the oldest pending approval",
            ["kind"],
            registry=registry,
        )
        self.claim_conflicts = Counter(
            "parley_authz_claim_conflicts",
            "Decide calls that did not take the claim: a repeat, a conflicting decision or a lost race",
            registry=registry,
        )
        self.burned = Counter(
            "parley_authz_burned",
            "Capability decisions deleted as dead authority, by reason (snapshot, expired; unused: expired,"
            " never authorized, and swept)",
            ["reason"],
            registry=registry,
        )
        self.leases_active = Gauge(
            "parley_authz_leases_active", "Interaction leases live now (all agents)", registry=registry
        )
        self.lease_conflicts = Counter(
            "parley_authz_lease_conflicts",
            "Lease acquisitions and releases refused because another holder has the resource or lease id",
            registry=registry,
        )
        self.time_to_decide = Histogram(
            "parley_authz_time_to_decide_seconds",
            "Time from a tool call's proposal to its decision (by a person or by expiry)",
            buckets=DECIDE_BUCKETS,
            registry=registry,
        )
        for kind in PENDING_KINDS:
            self.pending.labels(kind)
            self.pending_age.labels(kind)
