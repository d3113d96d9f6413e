//! The SQL of each store step on PostgreSQL, for one table.
//!
//! Times are compared with the database's clock (`now()`, the start of the
//! statement's transaction, which for these single-statement steps is the
//! statement itself); durations are bound as microseconds.

use crate::row::{COMPLETED, IN_PROGRESS};
use crate::table::Table;

/// The statements of every store step, with the table name spliced in.
#[derive(Debug)]
pub(super) struct Statements {
    /// `$1` scope, `$2` key, `$3` fingerprint, `$4` owner, `$5` lease µs,
    /// `$6` retention µs → zero or one `ClaimRow`.
    pub(super) claim: String,
    /// The claim of transactional mode, in the execution's transaction: as
    /// `claim`, gated by the key's advisory lock (`$7` class, `$8` lock key
    /// text), with the transaction's lock waits bounded (`$9`, e.g. `5000ms`),
    /// its idle time (`$10`) and the server's TCP keepalives on the session
    /// (`$11` idle s, `$12` interval s, `$13` count, `$14` user timeout ms), all
    /// local to the transaction.
    /// When the lock is held, one `ClaimRow` that stands for the invisible
    /// in-progress record (the request's own fingerprint, its lease).
    pub(super) transactional_claim: String,
    /// `$1` scope, `$2` key, `$3` owner, `$4` lease µs → rows updated.
    pub(super) renew: String,
    /// `$1` scope, `$2` key, `$3` owner, `$4` status, `$5` headers, `$6` body,
    /// `$7` replayable, `$8` retention µs → rows updated.
    pub(super) complete: String,
    /// `$1` scope, `$2` key, `$3` owner → rows deleted.
    pub(super) release: String,
    /// `$1` scope, `$2` key → zero or one `RecordRow`.
    pub(super) load: String,
    /// `$1` batch size → rows deleted.
    pub(super) delete_expired: String,
    /// `$1` scope, `$2` key → one `InProgressRow`.
    pub(super) in_progress: String,
}

/// The columns of a `RecordRow`, read from the row alias `r`.
const RECORD_COLUMNS: &str = "r.fingerprint, r.state, uuid_send(r.owner) AS owner, \
    (extract(epoch FROM r.lease_until) * 1000000)::bigint AS lease_until, \
    r.status, r.headers, r.body, r.replayable, \
    (extract(epoch FROM r.expires_at) * 1000000)::bigint AS expires_at";

impl Statements {
    pub(super) fn new(table: &Table) -> Self {
        let t = table.sql();
        // A record counts as new when it is completed and past its retention, or
        // in progress and past its lease. An in-progress record past its
        // retention but under a live lease is still being worked on.
        let claimable = format!(
            "(r.state = '{COMPLETED}' AND r.expires_at <= now()) \
             OR (r.state = '{IN_PROGRESS}' AND r.lease_until <= now())"
        );
        let expired = format!(
            "r.expires_at <= now() AND (r.state = '{COMPLETED}' OR r.lease_until <= now())"
        );
        let upsert = format!(
            "ON CONFLICT (scope, key) DO UPDATE SET
                        fingerprint = excluded.fingerprint,
                        state = excluded.state,
                        owner = excluded.owner,
                        lease_until = excluded.lease_until,
                        status = NULL, headers = NULL, body = NULL, replayable = NULL,
                        expires_at = excluded.expires_at,
                        created_at = excluded.created_at
                    WHERE {claimable}
                    RETURNING {RECORD_COLUMNS}"
        );
        Self {
            // The gate runs first (a CTE with volatile functions is evaluated
            // once, before the statements that read it). When another
            // execution's transaction holds the key, its record is uncommitted
            // and invisible: the third branch answers in its place.
            transactional_claim: format!(
                "WITH gate AS MATERIALIZED (
                    SELECT set_config('lock_timeout', $9, true) AS lock_timeout,
                           set_config('idle_in_transaction_session_timeout', $10, true)
                               AS idle_timeout,
                           set_config('tcp_keepalives_idle', $11, true) AS keepalives_idle,
                           set_config('tcp_keepalives_interval', $12, true)
                               AS keepalives_interval,
                           set_config('tcp_keepalives_count', $13, true) AS keepalives_count,
                           set_config('tcp_user_timeout', $14, true) AS user_timeout,
                           pg_try_advisory_xact_lock($7, hashtext($8)) AS free
                ), claimed AS (
                    INSERT INTO {t} AS r
                        (scope, key, fingerprint, state, owner, lease_until, expires_at, created_at)
                    SELECT $1, $2, $3, '{IN_PROGRESS}', $4,
                           now() + $5 * interval '1 microsecond',
                           now() + $6 * interval '1 microsecond', now()
                    FROM gate WHERE gate.free
                    {upsert}
                )
                SELECT true AS claimed, * FROM claimed
                UNION ALL
                SELECT false AS claimed, {RECORD_COLUMNS} FROM {t} AS r, gate
                WHERE gate.free AND r.scope = $1 AND r.key = $2
                  AND NOT ({claimable})
                  AND NOT EXISTS (SELECT 1 FROM claimed)
                UNION ALL
                SELECT false AS claimed, $3, '{IN_PROGRESS}', uuid_send($4),
                       (extract(epoch FROM now() + $5 * interval '1 microsecond') * 1000000)::bigint,
                       NULL::integer, NULL::bytea, NULL::bytea, NULL::boolean,
                       (extract(epoch FROM now() + $6 * interval '1 microsecond') * 1000000)::bigint
                FROM gate WHERE NOT gate.free"
            ),
            // One statement, one round trip. The upsert claims a new, expired or
            // lapsed record and returns it; otherwise the second branch returns the
            // record as the statement's snapshot saw it. That snapshot predates the
            // statement, so it misses a row another transaction committed while
            // the upsert waited on it: then neither branch returns a row (or the
            // snapshot's row is itself claimable) and the caller runs the statement
            // again with a fresh snapshot.
            claim: format!(
                "WITH claimed AS (
                    INSERT INTO {t} AS r
                        (scope, key, fingerprint, state, owner, lease_until, expires_at, created_at)
                    VALUES ($1, $2, $3, '{IN_PROGRESS}', $4,
                            now() + $5 * interval '1 microsecond',
                            now() + $6 * interval '1 microsecond', now())
                    ON CONFLICT (scope, key) DO UPDATE SET
                        fingerprint = excluded.fingerprint,
                        state = excluded.state,
                        owner = excluded.owner,
                        lease_until = excluded.lease_until,
                        status = NULL, headers = NULL, body = NULL, replayable = NULL,
                        expires_at = excluded.expires_at,
                        created_at = excluded.created_at
                    WHERE {claimable}
                    RETURNING {RECORD_COLUMNS}
                )
                SELECT true AS claimed, * FROM claimed
                UNION ALL
                SELECT false AS claimed, {RECORD_COLUMNS} FROM {t} AS r
                WHERE r.scope = $1 AND r.key = $2
                  AND NOT ({claimable})
                  AND NOT EXISTS (SELECT 1 FROM claimed)"
            ),
            renew: format!(
                "UPDATE {t} AS r SET lease_until = now() + $4 * interval '1 microsecond'
                 WHERE r.scope = $1 AND r.key = $2 AND r.owner = $3 AND r.state = '{IN_PROGRESS}'"
            ),
            complete: format!(
                "UPDATE {t} AS r SET
                    state = '{COMPLETED}', owner = NULL, lease_until = NULL,
                    status = $4, headers = $5, body = $6, replayable = $7,
                    expires_at = now() + $8 * interval '1 microsecond'
                 WHERE r.scope = $1 AND r.key = $2 AND r.owner = $3 AND r.state = '{IN_PROGRESS}'"
            ),
            release: format!(
                "DELETE FROM {t} AS r
                 WHERE r.scope = $1 AND r.key = $2 AND r.owner = $3 AND r.state = '{IN_PROGRESS}'"
            ),
            load: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} AS r
                 WHERE r.scope = $1 AND r.key = $2 AND NOT ({expired})"
            ),
            // `ctid = ANY(ARRAY(…))` is a TID scan: the batch is found through the
            // `expires_at` index and deleted by its physical address, without a
            // scan of the table. The outer condition is checked again on the row
            // version the delete meets, so a record claimed anew in between (a new
            // version) survives.
            delete_expired: format!(
                "DELETE FROM {t} AS r
                 WHERE r.ctid = ANY(ARRAY(
                     SELECT r.ctid FROM {t} AS r WHERE {expired} LIMIT $1))
                   AND {expired}"
            ),
            in_progress: format!(
                "SELECT EXISTS(
                     SELECT 1 FROM {t} AS r
                     WHERE r.scope = $1 AND r.key = $2
                       AND r.state = '{IN_PROGRESS}' AND r.lease_until > now()
                 ) AS in_progress"
            ),
        }
    }
}
