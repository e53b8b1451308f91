-- Named queries of the authz service. Each `-- name --` header starts one statement.
-- A state change is one statement naming the state it expects; when it changes
-- nothing, the caller reads the record only to say why.

-- ===== 1. Tool-call decisions ===============================================

-- put_pending --
-- Insert if absent; the same call again returns the stored record (created =
-- false). No row comes back only while a concurrent first insert commits: read it then.
WITH inserted AS (
    INSERT INTO authz.tool_call (agent_id, id, conversation_id, message_id, call_index, tool, args_digest,
                                 summary, proposed_at, expires_at, on_expiry)
    VALUES (%(agent_id)s, %(id)s, %(conversation_id)s, %(message_id)s, %(call_index)s, %(tool)s,
            %(args_digest)s, %(summary)s, coalesce(%(proposed_at)s::timestamptz, now()),
            %(expires_at)s::timestamptz, %(on_expiry)s)
    ON CONFLICT (agent_id, id) DO NOTHING
    RETURNING *
)
SELECT true AS created, inserted.*, false AS expired FROM inserted
UNION ALL
SELECT false, t.*, coalesce(t.expires_at <= now(), false)
  FROM authz.tool_call t
 WHERE t.agent_id = %(agent_id)s AND t.id = %(id)s AND NOT EXISTS (SELECT 1 FROM inserted);

-- get_tool_call --
SELECT *, coalesce(expires_at <= now(), false) AS expired
  FROM authz.tool_call
 WHERE agent_id = %(agent_id)s AND id = %(id)s;

-- decide --
-- The claim: pending (and not expired) -> claimed for an approval, with the
-- caller's fresh token; pending -> settled for a denial, which never runs.
UPDATE authz.tool_call
   SET status = CASE WHEN %(decision)s::text = 'approve' THEN 'claimed' ELSE 'settled' END,
       decision = %(decision)s::text,
       reason = %(reason)s::text,
       decided_by = %(decided_by)s::text,
       decided_at = now(),
       claim_token = %(claim_token)s::uuid,
       claimed_at = CASE WHEN %(decision)s::text = 'approve' THEN now() END,
       outcome = CASE WHEN %(decision)s::text = 'deny' THEN 'denied' END,
       settled_by = CASE WHEN %(decision)s::text = 'deny' THEN %(decided_by)s::text END,
       settled_at = CASE WHEN %(decision)s::text = 'deny' THEN now() END
 WHERE agent_id = %(agent_id)s AND id = %(id)s AND status = 'pending'
   AND (expires_at IS NULL OR expires_at > now())
RETURNING *, false AS expired;

-- settle --
-- claimed -> settled, only with the claim's own token (fencing).
UPDATE authz.tool_call
   SET status = 'settled', outcome = %(outcome)s, result = %(result)s, settled_by = %(settled_by)s,
       settled_at = now()
 WHERE agent_id = %(agent_id)s AND id = %(id)s AND status = 'claimed' AND claim_token = %(claim_token)s
RETURNING *, false AS expired;

-- list_pending_tool_calls --
SELECT *, false AS expired
  FROM authz.tool_call
 WHERE agent_id = %(agent_id)s AND status = 'pending' AND (expires_at IS NULL OR expires_at > now())
   AND (%(conversation_id)s::text IS NULL OR conversation_id = %(conversation_id)s::text)
 ORDER BY proposed_at, id
 LIMIT %(limit)s OFFSET %(offset)s;

-- list_stuck_tool_calls --
-- Claims whose executor has not settled them: never reset or re-run, only
-- settled explicitly by an operator.
SELECT *, false AS expired
  FROM authz.tool_call
 WHERE agent_id = %(agent_id)s AND status = 'claimed'
   AND claimed_at <= now() - make_interval(secs => %(older_than)s)
 ORDER BY claimed_at, id
 LIMIT %(limit)s OFFSET %(offset)s;

-- list_message_tool_calls --
SELECT *, coalesce(expires_at <= now(), false) AS expired
  FROM authz.tool_call
 WHERE agent_id = %(agent_id)s AND conversation_id = %(conversation_id)s AND message_id = %(message_id)s
 ORDER BY call_index
 LIMIT 1000;

-- expire_due_tool_calls --
-- Due pending calls take their expiry decision: deny settles them as
-- expired, approve claims them like an approval. SKIP LOCKED leaves a call
-- being decided right now to that decision.
WITH due AS (
    SELECT agent_id, id
      FROM authz.tool_call
     WHERE status = 'pending' AND expires_at <= now()
     ORDER BY expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
UPDATE authz.tool_call t
   SET status = CASE WHEN t.on_expiry = 'approve' THEN 'claimed' ELSE 'settled' END,
       decision = t.on_expiry,
       decided_by = 'expiry',
       decided_at = now(),
       claim_token = CASE WHEN t.on_expiry = 'approve' THEN gen_random_uuid() END,
       claimed_at = CASE WHEN t.on_expiry = 'approve' THEN now() END,
       outcome = CASE WHEN t.on_expiry = 'deny' THEN 'expired' END,
       settled_by = CASE WHEN t.on_expiry = 'deny' THEN 'expiry' END,
       settled_at = CASE WHEN t.on_expiry = 'deny' THEN now() END
  FROM due
 WHERE t.agent_id = due.agent_id AND t.id = due.id AND t.status = 'pending'
RETURNING t.*, true AS expired;

-- unannounced_tool_calls --
-- Decisions whose event was not recorded as published within the grace period.
SELECT *, false AS expired
  FROM authz.tool_call
 WHERE status <> 'pending' AND announced IS DISTINCT FROM status
   AND coalesce(settled_at, claimed_at) <= now() - make_interval(secs => %(grace)s)
 ORDER BY decided_at
 LIMIT %(limit)s;

-- mark_announced --
-- One statement for a whole batch of published events.
UPDATE authz.tool_call t
   SET announced = v.status
  FROM unnest(%(agent_ids)s::uuid[], %(ids)s::text[], %(statuses)s::text[]) AS v (agent_id, id, status)
 WHERE t.agent_id = v.agent_id AND t.id = v.id AND t.status = v.status
   AND t.announced IS DISTINCT FROM v.status;

-- gauges --
-- Pending work by kind, with the age of the oldest, and live leases; for the gauges.
SELECT 'tool_call' AS kind, count(*) AS n,
       coalesce(extract(epoch FROM now() - min(proposed_at)), 0)::float8 AS oldest_seconds
  FROM authz.tool_call
 WHERE status = 'pending' AND (expires_at IS NULL OR expires_at > now())
UNION ALL
SELECT 'capability_decision', count(*), coalesce(extract(epoch FROM now() - min(registered_at)), 0)::float8
  FROM authz.capability_decision
 WHERE expires_at > now()
UNION ALL
SELECT 'capability_confirmation', count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
  FROM authz.capability_confirmation
 WHERE state = 'pending' AND expires_at > now()
UNION ALL
SELECT 'interaction_confirmation', count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
  FROM authz.interaction_confirmation
 WHERE state = 'pending' AND expires_at > now()
UNION ALL
SELECT 'lease', count(*), 0::float8
  FROM authz.lease
 WHERE expires_at > now();

-- ===== 2. Capability authorization ==========================================

-- put_account_snapshot --
-- A new version becomes the account's snapshot; a version seen before is
-- never current again (created = false, current tells a replay of the current one).
WITH inserted AS (
    INSERT INTO authz.account_snapshot (agent_id, account_id, snapshot_version)
    VALUES (%(agent_id)s, %(account_id)s, %(snapshot_version)s)
    ON CONFLICT DO NOTHING
    RETURNING seq
)
SELECT EXISTS (SELECT 1 FROM inserted) AS created,
       authz.snapshot_is_current(%(agent_id)s, %(account_id)s, %(snapshot_version)s) AS current;

-- revoke_account_snapshot --
UPDATE authz.account_snapshot
   SET revoked_at = now()
 WHERE agent_id = %(agent_id)s AND account_id = %(account_id)s AND revoked_at IS NULL
RETURNING snapshot_version;

-- register_decision --
-- Spends the decision id (and confirmation id) in the ledger and records the
-- live decision, only while its snapshot is current and it has not expired.
-- An id already in the ledger registers nothing: a retry of the same
-- registration finds its decision still there (registered_digest).
WITH registrable AS (
    SELECT authz.snapshot_is_current(%(agent_id)s, %(account_id)s::text, %(snapshot_version)s::text) AS current,
           %(expires_at)s::timestamptz > now() AS live
), spent AS (
    INSERT INTO authz.capability_id (agent_id, kind, id)
    SELECT %(agent_id)s, v.kind, v.id
      FROM (VALUES ('decision', %(decision_id)s::text), ('confirmation', %(confirmation_id)s::text)) AS v (kind, id),
           registrable r
     WHERE v.id IS NOT NULL AND r.current AND r.live
    ON CONFLICT DO NOTHING
    RETURNING kind
), decision AS (
    INSERT INTO authz.capability_decision (agent_id, decision_id, decision_digest, request_digest, outcome,
                                           confirmation_id, account_id, snapshot_version, capability,
                                           operation, risk, input_digest, issued_at, expires_at)
    SELECT %(agent_id)s, %(decision_id)s::text, %(decision_digest)s::text, %(request_digest)s::text,
           %(outcome)s::text, %(confirmation_id)s::text, %(account_id)s::text, %(snapshot_version)s::text,
           %(capability)s::text, %(operation)s::text, %(risk)s::text, %(input_digest)s::text,
           %(issued_at)s::timestamptz, %(expires_at)s::timestamptz
     WHERE (SELECT count(*) FROM spent) = %(id_count)s
    RETURNING decision_id
), confirmation AS (
    INSERT INTO authz.capability_confirmation (agent_id, confirmation_id, decision_id, expires_at)
    SELECT %(agent_id)s, %(confirmation_id)s::text, decision.decision_id, %(expires_at)s::timestamptz
      FROM decision
     WHERE %(confirmation_id)s::text IS NOT NULL
)
SELECT r.current, r.live,
       EXISTS (SELECT 1 FROM decision) AS created,
       ARRAY(SELECT kind FROM spent) AS spent,
       (SELECT d.decision_digest FROM authz.capability_decision d
         WHERE d.agent_id = %(agent_id)s AND d.decision_id = %(decision_id)s::text) AS registered_digest
  FROM registrable r;

-- issue_confirmation --
-- pending -> issued, for that decision only, while the decision is live.
UPDATE authz.capability_confirmation c
   SET state = 'issued', grant_id = %(grant_id)s, grant_digest = %(grant_digest)s,
       issued_by = %(issued_by)s, issued_at = %(issued_at)s
  FROM authz.capability_decision d
 WHERE c.agent_id = %(agent_id)s AND c.confirmation_id = %(confirmation_id)s AND c.state = 'pending'
   AND c.decision_id = %(decision_id)s
   AND d.agent_id = c.agent_id AND d.decision_id = c.decision_id AND d.decision_digest = %(decision_digest)s
   AND d.expires_at > now()
   AND authz.snapshot_is_current(d.agent_id, d.account_id, d.snapshot_version)
RETURNING c.confirmation_id;

-- confirmation_seen --
-- Why issue_confirmation changed nothing.
SELECT c.state, c.decision_id, d.decision_digest, coalesce(d.expires_at > now(), false) AS live,
       coalesce(authz.snapshot_is_current(d.agent_id, d.account_id, d.snapshot_version), false) AS current,
       d.decision_id IS NOT NULL AS decision_exists
  FROM authz.capability_confirmation c
  LEFT JOIN authz.capability_decision d ON d.agent_id = c.agent_id AND d.decision_id = c.decision_id
 WHERE c.agent_id = %(agent_id)s AND c.confirmation_id = %(confirmation_id)s;

-- authorize --
-- One compare-and-delete. The decision is deleted when it is current,
-- unexpired, issued for this request and (if confirmation is required)
-- confirmed by this grant: then the authorization is recorded and the grant
-- consumed. It is deleted too, as burned, when its account snapshot is no
-- longer current or it has expired: dead authority never comes back. `seen` is
-- the statement's snapshot of the decision, only to say why nothing happened.
WITH seen AS (
    SELECT d.request_digest, d.decision_digest, d.confirmation_id,
           d.expires_at > now() AS live,
           authz.snapshot_is_current(d.agent_id, d.account_id, d.snapshot_version) AS current,
           c.state AS confirmation_state, c.grant_digest AS confirmation_grant_digest
      FROM authz.capability_decision d
      LEFT JOIN authz.capability_confirmation c
        ON c.agent_id = d.agent_id AND c.confirmation_id = d.confirmation_id
     WHERE d.agent_id = %(agent_id)s AND d.decision_id = %(decision_id)s
), consumed AS (
    DELETE FROM authz.capability_decision d
     WHERE d.agent_id = %(agent_id)s AND d.decision_id = %(decision_id)s
       AND (d.expires_at <= now()
            OR NOT authz.snapshot_is_current(d.agent_id, d.account_id, d.snapshot_version)
            OR (d.request_digest = %(request_digest)s AND d.decision_digest = %(decision_digest)s
                AND CASE WHEN d.confirmation_id IS NULL THEN %(grant_digest)s::text IS NULL
                         ELSE EXISTS (SELECT 1 FROM authz.capability_confirmation c
                                       WHERE c.agent_id = d.agent_id AND c.confirmation_id = d.confirmation_id
                                         AND c.state = 'issued' AND c.grant_digest = %(grant_digest)s::text)
                    END))
    RETURNING d.*, d.expires_at > now() AS live,
              authz.snapshot_is_current(d.agent_id, d.account_id, d.snapshot_version) AS current
), authorized AS (
    INSERT INTO authz.capability_authorization (agent_id, id, request_digest, decision_id, decision_digest,
                                                grant_digest, account_id, snapshot_version, capability,
                                                operation, risk, input_digest, authorized_at)
    SELECT agent_id, %(authorization_id)s::text, request_digest, decision_id, decision_digest,
           %(grant_digest)s::text, account_id, snapshot_version, capability, operation, risk, input_digest,
           date_trunc('milliseconds', now())
      FROM consumed
     WHERE live AND current
    RETURNING *
), grant_spent AS (
    UPDATE authz.capability_confirmation c
       SET state = CASE WHEN EXISTS (SELECT 1 FROM authorized) THEN 'consumed' ELSE 'burned' END,
           finished_at = now()
      FROM consumed
     WHERE c.agent_id = consumed.agent_id AND c.confirmation_id = consumed.confirmation_id
       AND c.state IN ('pending', 'issued')
)
SELECT a.id, a.agent_id, a.request_digest, a.decision_id, a.decision_digest, a.grant_digest, a.account_id,
       a.snapshot_version, a.capability, a.operation, a.risk, a.input_digest, a.authorized_at,
       c.decision_id IS NOT NULL AS deleted, c.live AS deleted_live, c.current AS deleted_current,
       s.request_digest AS seen_request_digest, s.decision_digest AS seen_decision_digest,
       s.confirmation_id AS seen_confirmation_id, s.live AS seen_live, s.current AS seen_current,
       s.confirmation_state AS seen_confirmation_state,
       s.confirmation_grant_digest AS seen_grant_digest,
       EXISTS (SELECT 1 FROM authz.capability_id i
                WHERE i.agent_id = %(agent_id)s AND i.kind = 'decision' AND i.id = %(decision_id)s) AS known
  FROM (SELECT 1) AS one
  LEFT JOIN consumed c ON true
  LEFT JOIN authorized a ON true
  LEFT JOIN seen s ON true;

-- sweep_expired_decisions --
-- Decisions that expired more than `retention_seconds` ago and were never authorized: deleted, and
-- their pending or issued confirmations burned, as Authorize burns an expired decision. Their ids
-- stay spent in capability_id, so none can be registered again, and an Authorize of one is
-- refused as consumed or burned. Without it they stayed forever, and the gauges read all of them
-- every few seconds. A batch at a time; replicas sweeping at once skip each other's rows.
WITH dead AS (
    DELETE FROM authz.capability_decision d
     USING (SELECT agent_id, decision_id
              FROM authz.capability_decision
             WHERE expires_at <= now() - greatest(%(retention_seconds)s, 0) * interval '1 second'
             LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED) AS due
     WHERE d.agent_id = due.agent_id AND d.decision_id = due.decision_id
    RETURNING d.agent_id, d.confirmation_id
), burned AS (
    UPDATE authz.capability_confirmation c
       SET state = 'burned', finished_at = now()
      FROM dead
     WHERE c.agent_id = dead.agent_id AND c.confirmation_id = dead.confirmation_id
       AND c.state IN ('pending', 'issued')
)
SELECT count(*)::int AS swept FROM dead;

-- record_receipt --
-- Recorded once per authorization, only when it cites that authorization
-- exactly and its chronology holds (authorized <= committed <= observed <= now);
-- `a` and the existing receipt say why when it is not.
WITH a AS (
    SELECT *
      FROM authz.capability_authorization
     WHERE agent_id = %(agent_id)s AND id = %(authorization_id)s
), recorded AS (
    INSERT INTO authz.capability_receipt (agent_id, authorization_id, receipt_digest, status, error_code,
                                          committed_at, observed_at)
    SELECT a.agent_id, a.id, %(receipt_digest)s::text, %(status)s::text, %(error_code)s::text,
           %(committed_at)s::timestamptz, %(observed_at)s::timestamptz
      FROM a
     WHERE a.request_digest = %(request_digest)s::text AND a.decision_digest = %(decision_digest)s::text
       AND a.grant_digest IS NOT DISTINCT FROM %(grant_digest)s::text
       AND a.account_id = %(account_id)s::text AND a.capability = %(capability)s::text
       AND a.operation = %(operation)s::text AND a.input_digest = %(input_digest)s::text
       AND a.request_digest = %(idempotency_key)s::text
       AND a.authorized_at <= coalesce(%(committed_at)s::timestamptz, %(observed_at)s::timestamptz)
       AND %(observed_at)s::timestamptz <= now()
    ON CONFLICT (agent_id, authorization_id) DO NOTHING
    RETURNING recorded_at
)
SELECT (SELECT recorded_at FROM recorded) AS recorded_at, now() AS db_now,
       a.id IS NOT NULL AS authorization_exists, a.id, a.agent_id, a.request_digest, a.decision_id,
       a.decision_digest, a.grant_digest, a.account_id, a.snapshot_version, a.capability, a.operation, a.risk,
       a.input_digest, a.authorized_at,
       r.receipt_digest AS existing_digest, r.recorded_at AS existing_recorded_at
  FROM (SELECT 1) AS one
  LEFT JOIN a ON true
  LEFT JOIN authz.capability_receipt r ON r.agent_id = a.agent_id AND r.authorization_id = a.id;

-- ===== 3. Interaction leases ================================================

-- acquire_lease --
-- A free resource, or one whose lease has expired by the database's clock, is
-- granted with a new fencing token; a live holder keeps it (no row).
INSERT INTO authz.lease AS l (agent_id, resource_kind, resource_id, lease_id, session_id, owner, generation,
                              fencing_token, acquired_at, renewed_at, expires_at)
VALUES (%(agent_id)s, %(resource_kind)s, %(resource_id)s, %(lease_id)s, %(session_id)s, %(owner)s,
        %(generation)s, nextval('authz.lease_fencing_token'), now(), now(),
        now() + %(ttl_ms)s * interval '1 millisecond')
ON CONFLICT (agent_id, resource_kind, resource_id) DO UPDATE
   SET lease_id = excluded.lease_id, session_id = excluded.session_id, owner = excluded.owner,
       generation = excluded.generation, fencing_token = excluded.fencing_token,
       acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at, expires_at = excluded.expires_at
 WHERE l.expires_at <= now()
RETURNING *, true AS live;

-- lease_of_resource --
SELECT *, expires_at > now() AS live
  FROM authz.lease
 WHERE agent_id = %(agent_id)s AND resource_kind = %(resource_kind)s AND resource_id = %(resource_id)s;

-- renew_lease --
-- Only a live lease, by its holder; acquired_at and the fencing token stay.
UPDATE authz.lease
   SET renewed_at = now(), expires_at = now() + %(ttl_ms)s * interval '1 millisecond'
 WHERE agent_id = %(agent_id)s AND lease_id = %(lease_id)s AND session_id = %(session_id)s
   AND owner = %(owner)s AND generation = %(generation)s AND expires_at > now()
RETURNING *, true AS live;

-- release_lease --
WITH held AS (
    SELECT lease_id FROM authz.lease WHERE agent_id = %(agent_id)s AND lease_id = %(lease_id)s
), released AS (
    DELETE FROM authz.lease
     WHERE agent_id = %(agent_id)s AND lease_id = %(lease_id)s AND session_id = %(session_id)s
       AND owner = %(owner)s AND generation = %(generation)s
    RETURNING lease_id
)
SELECT EXISTS (SELECT 1 FROM released) AS released, EXISTS (SELECT 1 FROM held) AS held;

-- leases_by_id --
SELECT *, expires_at > now() AS live
  FROM authz.lease
 WHERE agent_id = %(agent_id)s AND lease_id = ANY(%(lease_ids)s::text[]);

-- list_leases --
SELECT *, expires_at > now() AS live
  FROM authz.lease
 WHERE agent_id = %(agent_id)s AND (%(include_expired)s::boolean OR expires_at > now())
 ORDER BY resource_kind, resource_id
 LIMIT %(limit)s OFFSET %(offset)s;

-- ===== 4. Interaction confirmations =========================================

-- register_interaction_confirmation --
WITH inserted AS (
    INSERT INTO authz.interaction_confirmation (agent_id, confirmation_id, action_digest, expires_at)
    VALUES (%(agent_id)s, %(confirmation_id)s, %(action_digest)s,
            now() + %(ttl_ms)s * interval '1 millisecond')
    ON CONFLICT DO NOTHING
    RETURNING *
)
SELECT true AS created, inserted.*, true AS live FROM inserted
UNION ALL
SELECT false, c.*, c.expires_at > now()
  FROM authz.interaction_confirmation c
 WHERE c.agent_id = %(agent_id)s AND c.confirmation_id = %(confirmation_id)s
   AND NOT EXISTS (SELECT 1 FROM inserted);

-- issue_interaction_confirmation --
UPDATE authz.interaction_confirmation
   SET state = 'issued', grant_id = %(grant_id)s, issued_at = now()
 WHERE agent_id = %(agent_id)s AND confirmation_id = %(confirmation_id)s AND state = 'pending'
   AND action_digest = %(action_digest)s AND expires_at > now()
RETURNING *, true AS live;

-- get_interaction_confirmation --
SELECT *, expires_at > now() AS live
  FROM authz.interaction_confirmation
 WHERE agent_id = %(agent_id)s AND confirmation_id = %(confirmation_id)s;

-- consume_interaction_confirmation --
-- issued -> consumed, once, with the grant and the digest of the action as it is dispatched.
WITH seen AS (
    SELECT state, grant_id, action_digest, expires_at > now() AS live
      FROM authz.interaction_confirmation
     WHERE agent_id = %(agent_id)s AND confirmation_id = %(confirmation_id)s
), consumed AS (
    UPDATE authz.interaction_confirmation
       SET state = 'consumed', consumed_at = now()
     WHERE agent_id = %(agent_id)s AND confirmation_id = %(confirmation_id)s AND state = 'issued'
       AND grant_id = %(grant_id)s AND action_digest = %(action_digest)s AND expires_at > now()
    RETURNING *, true AS live
)
SELECT c.agent_id, c.confirmation_id, c.action_digest, c.state, c.grant_id, c.created_at, c.expires_at, c.live,
       s.state AS seen_state, s.grant_id AS seen_grant_id, s.action_digest AS seen_action_digest,
       s.live AS seen_live
  FROM (SELECT 1) AS one
  LEFT JOIN consumed c ON true
  LEFT JOIN seen s ON true;
