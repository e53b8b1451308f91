"""The ``parley.v1.Pairing`` service, served over gRPC and NATS.

Every method validates its whole request before it touches storage, so bad
input is INVALID_ARGUMENT naming the field even when the database is down.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from prometheus_client import CollectorRegistry, Counter, Gauge

from parley.v1 import common_pb2, pairing_pb2
from parley_platform import codes
from parley_platform.convert import timestamp
from parley_platform.logging import get_logger
from parley_platform.paging import MAX_LIMIT, Page, cut, page_bounds

from . import domain, errors
from .domain import AllowEntry, PendingRequest, UpsertOutcome
from .store import PairingStore

log = get_logger(__name__)

OUTCOMES = {
    UpsertOutcome.CREATED: pairing_pb2.UPSERT_OUTCOME_CREATED,
    UpsertOutcome.EXISTING: pairing_pb2.UPSERT_OUTCOME_EXISTING,
    UpsertOutcome.FULL: pairing_pb2.UPSERT_OUTCOME_FULL,
}
_SCALARS = {FieldDescriptor.TYPE_STRING: "a string", FieldDescriptor.TYPE_BOOL: "a bool"}
_REQUIREMENTS = {"limit": f"an integer from 1 to {MAX_LIMIT}", "offset": "an integer of 0 or more"}


class PairingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "parley_pairing_requests_total",
            "Pairing request upserts, by channel and outcome (created, existing, full)",
            ["channel", "outcome"],
            registry=registry,
        )
        self.pending = Gauge(
            "parley_pairing_pending",
            "Live pending pairing requests per channel, refreshed from the database by each replica",
            ["channel"],
            registry=registry,
        )
        self.approvals = Counter(
            "parley_pairing_approvals_total", "Pairing codes approved", registry=registry
        )
        self.denied = Counter(
            "parley_pairing_denied_messages_total",
            "Messages from senders that are not on the allowlist (IsAllowed answered false)",
            registry=registry,
        )
        self._channels: set[str] = set()

    def set_pending(self, counts: dict[str, int]) -> None:
        # A channel whose requests all went away reads 0, not its last value.
        for channel in self._channels - counts.keys():
            self.pending.labels(channel).set(0)
        for channel, count in counts.items():
            self.pending.labels(channel).set(count)
        self._channels |= counts.keys()


def well_formed(request: Message) -> None:
    """Reject a declared field sent with the wrong wire type.

    protobuf keeps such a field as an unknown field and leaves the declared one
    unset, so a client that encodes ``limit`` as the double 1.5 would otherwise
    get the default page instead of an error. Unknown field numbers are left
    alone: they are how newer clients talk to older servers.
    """
    unknown = UnknownFieldSet(request)
    if not len(unknown):
        return
    declared = request.DESCRIPTOR.fields_by_number
    for index in range(len(unknown)):
        field = declared.get(unknown[index].field_number)
        if field is None:
            continue
        if field.name in _REQUIREMENTS:
            raise codes.INVALID_PAGE(f"{field.name} must be {_REQUIREMENTS[field.name]}, got a non-integer")
        expected = field.message_type.name if field.message_type is not None else _SCALARS.get(field.type)
        raise errors.INVALID_FIELD(f"{field.name} has the wrong type (expected {expected or 'a number'})")


def request_pb(request: PendingRequest) -> pairing_pb2.PairingRequest:
    return pairing_pb2.PairingRequest(
        id=str(request.id),
        agent_id=str(request.agent_id),
        channel=request.channel,
        sender_id=request.sender_id,
        code=request.code,
        created_at=timestamp(request.created_at),
        last_seen_at=timestamp(request.last_seen_at),
        expires_at=timestamp(request.expires_at),
        metadata=request.metadata,
    )


def entry_pb(entry: AllowEntry) -> pairing_pb2.AllowlistEntry:
    return pairing_pb2.AllowlistEntry(
        id=str(entry.id),
        agent_id=str(entry.agent_id),
        channel=entry.channel,
        sender_id=entry.sender_id,
        created_at=timestamp(entry.created_at),
        added_by=entry.added_by,
        metadata=entry.metadata,
    )


def _page(request: pairing_pb2.ListPendingRequestsPageRequest | pairing_pb2.GetAllowlistPageRequest) -> Page:
    return Page(
        *page_bounds(
            request.limit if request.HasField("limit") else None,
            request.offset if request.HasField("offset") else None,
        )
    )


def _instant(micros: int) -> dict[str, int]:
    """A Timestamp's fields from epoch microseconds (protobuf builds it from the dict in C)."""
    seconds, fraction = divmod(micros, 1_000_000)
    return {"seconds": seconds, "nanos": fraction * 1000}


def _copy_page(
    page: common_pb2.PageResponse,
    response: pairing_pb2.ListPendingRequestsPageResponse | pairing_pb2.GetAllowlistPageResponse,
) -> None:
    """Pairing's pages carry the page fields inline rather than as a ``PageResponse``."""
    response.limit, response.offset, response.has_more = page.limit, page.offset, page.has_more
    if page.HasField("next_offset"):
        response.next_offset = page.next_offset


class PairingApi:
    def __init__(self, store: PairingStore, metrics: PairingMetrics) -> None:
        self.store = store
        self.metrics = metrics

    async def UpsertRequest(
        self, request: pairing_pb2.UpsertRequestRequest
    ) -> pairing_pb2.UpsertRequestResponse:
        well_formed(request)
        agent_id = domain.agent_uuid(request.agent_id)
        channel = domain.channel_name(request.channel)
        sender_id = domain.text_id(request.sender_id, "sender_id")
        metadata = domain.metadata(request.metadata)
        upserted = await self.store.upsert_request(agent_id, channel, sender_id, metadata)
        self.metrics.requests.labels(channel, upserted.outcome.value).inc()
        created = upserted.outcome is UpsertOutcome.CREATED
        if created:
            log.info("pairing request created", agent_id=str(agent_id), channel=channel)
        response = pairing_pb2.UpsertRequestResponse(created=created, outcome=OUTCOMES[upserted.outcome])
        if upserted.request is not None:
            response.request.CopyFrom(request_pb(upserted.request))
        return response

    async def ApproveCode(self, request: pairing_pb2.ApproveCodeRequest) -> pairing_pb2.ApproveCodeResponse:
        well_formed(request)
        agent_id = domain.agent_uuid(request.agent_id)
        channel = domain.channel_name(request.channel)
        code = domain.normalize_code(request.code)
        approved_by = domain.actor(request.approved_by, "approved_by")
        approved = await self.store.approve_code(agent_id, channel, code, approved_by)
        if approved is None:
            raise errors.CODE_NOT_FOUND(f"no pending request with that code in channel {channel!r}")
        pending, entry = approved
        self.metrics.approvals.inc()
        log.info("pairing code approved", agent_id=str(agent_id), channel=channel, approved_by=approved_by)
        return pairing_pb2.ApproveCodeResponse(entry=entry_pb(entry), request=request_pb(pending))

    async def DenyCode(self, request: pairing_pb2.DenyCodeRequest) -> pairing_pb2.DenyCodeResponse:
        well_formed(request)
        agent_id = domain.agent_uuid(request.agent_id)
        channel = domain.channel_name(request.channel)
        code = domain.normalize_code(request.code)
        denied = await self.store.deny_code(agent_id, channel, code)
        if denied is None:
            raise errors.CODE_NOT_FOUND(f"no pending request with that code in channel {channel!r}")
        log.info("pairing code denied", agent_id=str(agent_id), channel=channel)
        return pairing_pb2.DenyCodeResponse(request=request_pb(denied))

    async def IsAllowed(self, request: pairing_pb2.IsAllowedRequest) -> pairing_pb2.IsAllowedResponse:
        well_formed(request)
        agent_id = domain.agent_uuid(request.agent_id)
        channel = domain.channel_name(request.channel)
        sender_id = domain.text_id(request.sender_id, "sender_id")
        allowed = await self.store.is_allowed(agent_id, channel, sender_id)
        if not allowed:
            self.metrics.denied.inc()
        return pairing_pb2.IsAllowedResponse(allowed=allowed)

    async def AddToAllowlist(
        self, request: pairing_pb2.AddToAllowlistRequest
    ) -> pairing_pb2.AddToAllowlistResponse:
        well_formed(request)
        agent_id = domain.agent_uuid(request.agent_id)
        channel = domain.channel_name(request.channel)
        sender_id = domain.text_id(request.sender_id, "sender_id")
        added_by = domain.actor(request.added_by, "added_by")
        metadata = domain.metadata(request.metadata)
        created, entry = await self.store.add_to_allowlist(agent_id, channel, sender_id, added_by, metadata)
        if created:
            log.info("allowlist entry added", agent_id=str(agent_id), channel=channel, added_by=added_by)
        return pairing_pb2.AddToAllowlistResponse(created=created, entry=entry_pb(entry))

    async def RemoveFromAllowlist(
        self, request: pairing_pb2.RemoveFromAllowlistRequest
    ) -> pairing_pb2.RemoveFromAllowlistResponse:
        well_formed(request)
        agent_id = domain.agent_uuid(request.agent_id)
        channel = domain.channel_name(request.channel)
        sender_id = domain.text_id(request.sender_id, "sender_id")
        existed = await self.store.remove_from_allowlist(agent_id, channel, sender_id)
        if existed:
            log.info("allowlist entry removed", agent_id=str(agent_id), channel=channel)
        return pairing_pb2.RemoveFromAllowlistResponse(existed=existed)

    async def ClaimPairingReply(
        self, request: pairing_pb2.ClaimPairingReplyRequest
    ) -> pairing_pb2.ClaimPairingReplyResponse:
        well_formed(request)
        agent_id = domain.agent_uuid(request.agent_id)
        channel = domain.channel_name(request.channel)
        sender_id = domain.text_id(request.sender_id, "sender_id")
        claimed, code = await self.store.claim_reply(agent_id, channel, sender_id)
        return pairing_pb2.ClaimPairingReplyResponse(claimed=claimed, code=code or "")

    async def ListPendingRequestsPage(
        self, request: pairing_pb2.ListPendingRequestsPageRequest
    ) -> pairing_pb2.ListPendingRequestsPageResponse:
        well_formed(request)
        agent_id = domain.agent_uuid(request.agent_id)
        channel = domain.channel_name(request.channel)
        page = _page(request)
        listed, cut_page = cut(page, await self.store.pending_page(agent_id, channel, page))
        response = pairing_pb2.ListPendingRequestsPageResponse()
        # Each item is built in place (a list handed to the constructor is copied item by item),
        # with the fields every item shares converted once.
        agent, items = str(agent_id), response.items
        for item in listed:
            added = items.add(
                id=item.id,
                agent_id=agent,
                channel=channel,
                sender_id=item.sender_id,
                code=item.code,
                created_at=_instant(item.created_us),
                last_seen_at=_instant(item.last_seen_us),
                expires_at=_instant(item.expires_us),
            )
            if item.metadata:
                added.metadata.update(item.metadata)
        _copy_page(cut_page, response)
        return response

    async def GetAllowlistPage(
        self, request: pairing_pb2.GetAllowlistPageRequest
    ) -> pairing_pb2.GetAllowlistPageResponse:
        well_formed(request)
        agent_id = domain.agent_uuid(request.agent_id)
        channel = domain.channel_name(request.channel)
        page = _page(request)
        listed, cut_page = cut(page, await self.store.allowlist_page(agent_id, channel, page))
        response = pairing_pb2.GetAllowlistPageResponse()
        agent, items = str(agent_id), response.items
        for entry in listed:
            added = items.add(
                id=entry.id,
                agent_id=agent,
                channel=channel,
                sender_id=entry.sender_id,
                created_at=_instant(entry.created_us),
                added_by=entry.added_by,
            )
            if entry.metadata:
                added.metadata.update(entry.metadata)
        _copy_page(cut_page, response)
        return response
