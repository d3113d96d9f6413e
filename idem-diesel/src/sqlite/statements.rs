//! The SQL of each store step on SQLite, for one table.
//!
//! Times are SQLite's own clock, read inside each statement ([`NOW`]): a step
//! that waited for a pooled connection or for another connection's write gets
//! a full lease from when it runs, not from when it was asked for, as PostgreSQL
//! uses the database's `now()`. Time columns hold microseconds since the Unix
//! epoch; durations are bound as microseconds.

use crate::row::{COMPLETED, IN_PROGRESS, RECLAIM, claimable, expired};
use crate::table::Table;

/// The current time, as microseconds since the Unix epoch, to the millisecond
/// (SQLite's `unixepoch('subsec')`). SQLite reads its clock once per statement
/// step, so every use within one statement sees the same instant.
pub(super) const NOW: &str = "(CAST(ROUND(unixepoch('subsec') * 1000) AS INTEGER) * 1000)";

/// The statements of every store step, with the table name spliced in.
#[derive(Debug)]
pub(super) struct Statements {
    /// `?1` scope, `?2` key, `?3` fingerprint, `?4` owner, `?5` lease (µs),
    /// `?6` retention (µs) → 1 row written if claimed, else 0.
    pub(super) claim: String,
    /// `?1` scope, `?2` key → the record that kept a claim out. Run in the
    /// claim's transaction, right after it wrote nothing: the record is there and
    /// was live when the claim ran.
    pub(super) found: String,
    /// `?1` scope, `?2` key, `?3` owner, `?4` lease (µs) → rows updated.
    pub(super) renew: String,
    /// `?1` scope, `?2` key, `?3` owner, `?4` status, `?5` headers, `?6` body,
    /// `?7` replayable, `?8` retention (µs) → rows updated.
    pub(super) complete: String,
    /// `?1` scope, `?2` key, `?3` owner → rows deleted.
    pub(super) release: String,
    /// `?1` scope, `?2` key → zero or one `RecordRow`.
    pub(super) load: String,
    /// `?1` scope, `?2` key → the record if a claim would not take it
    /// (completed within its retention, or in progress within its lease), read
    /// without the write lock: what a claim answers first.
    pub(super) live: String,
    /// `?1` batch size → rows deleted.
    pub(super) delete_expired: String,
    /// `?1` scope, `?2` key → one `InProgressRow`.
    pub(super) in_progress: String,
}

/// The columns of a `RecordRow`, read from the row alias `r`.
const RECORD_COLUMNS: &str = "r.fingerprint, r.state, r.owner, r.lease_until, \
    r.status, r.headers, r.body, r.replayable, r.expires_at";

impl Statements {
    pub(super) fn new(table: &Table) -> Self {
        let t = table.sql();
        // As on PostgreSQL: new when completed and past retention, or in progress
        // and past the lease.
        Self {
            claim: format!(
                "INSERT INTO {t} AS r
                    (scope, key, fingerprint, state, owner, lease_until, expires_at, created_at)
                 VALUES (?1, ?2, ?3, '{IN_PROGRESS}', ?4, {NOW} + ?5, {NOW} + ?6, {NOW})
                 {RECLAIM}
                 WHERE {}",
                claimable(NOW)
            ),
            found: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} AS r WHERE r.scope = ?1 AND r.key = ?2"
            ),
            renew: format!(
                "UPDATE {t} SET lease_until = {NOW} + ?4
                 WHERE scope = ?1 AND key = ?2 AND owner = ?3 AND state = '{IN_PROGRESS}'"
            ),
            complete: format!(
                "UPDATE {t} SET
                    state = '{COMPLETED}', owner = NULL, lease_until = NULL,
                    status = ?4, headers = ?5, body = ?6, replayable = ?7,
                    expires_at = {NOW} + ?8
                 WHERE scope = ?1 AND key = ?2 AND owner = ?3 AND state = '{IN_PROGRESS}'"
            ),
            release: format!(
                "DELETE FROM {t}
                 WHERE scope = ?1 AND key = ?2 AND owner = ?3 AND state = '{IN_PROGRESS}'"
            ),
            load: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} AS r
                 WHERE r.scope = ?1 AND r.key = ?2 AND NOT ({})",
                expired(NOW)
            ),
            live: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} AS r
                 WHERE r.scope = ?1 AND r.key = ?2 AND NOT ({})",
                claimable(NOW)
            ),
            delete_expired: format!(
                "DELETE FROM {t} WHERE rowid IN (
                     SELECT r.rowid FROM {t} AS r WHERE {} LIMIT ?1)",
                expired(NOW)
            ),
            in_progress: format!(
                "SELECT EXISTS(
                     SELECT 1 FROM {t}
                     WHERE scope = ?1 AND key = ?2
                       AND state = '{IN_PROGRESS}' AND lease_until > {NOW}
                 ) AS in_progress"
            ),
        }
    }
}
