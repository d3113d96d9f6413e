//! The SQL of each store step on PostgreSQL, for one table, and how it runs.
//!
//! Times are compared with the database's clock (`now()`, the start of the
//! statement's transaction, which for these single-statement steps is the
//! statement itself); durations are bound as microseconds.
//!
//! Each connection keeps every statement prepared. diesel's statement cache
//! finds a prepared statement by a key: by default its SQL text and bind types,
//! which costs a hash and a copy of the whole text (over a kilobyte for the
//! claim) on every execution. The statements of one table are keyed instead by
//! a type of their own ([`StatementKey`]), a lookup by `TypeId`. A type names
//! one text for the whole process, so only one table per process gets them: the
//! first one a store is built for. Stores over other tables (rare: several
//! tables in one process) fall back to the text key.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::OnceLock;

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId, SqlQuery};
use diesel::sql_types::Untyped;
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::row::{COMPLETED, IN_PROGRESS, RECLAIM, claimable, expired};
use crate::table::Table;

/// The statements of every store step, with the table name spliced in.
#[derive(Debug)]
pub(super) struct Statements {
    /// `$1` scope, `$2` key, `$3` fingerprint, `$4` owner, `$5` lease µs,
    /// `$6` retention µs → zero or one `ClaimRow`.
    pub(super) claim: Statement<Claim>,
    /// `$1` scope, `$2` key → the record as a `RecordRow` when it is live (a
    /// claim would not take it), without writing anything: what transactional
    /// mode looks at before it opens a transaction.
    pub(super) live: Statement<Live>,
    /// The claim of transactional mode, in the execution's transaction: as
    /// `claim`, gated by the key's advisory lock (`$7` class, `$8` lock key
    /// text), with the transaction's lock waits bounded (`$9`, e.g. `5000ms`),
    /// its idle time (`$10`) and the server's TCP keepalives on the session
    /// (`$11` idle s, `$12` interval s, `$13` count, `$14` user timeout ms), all
    /// local to the transaction.
    /// When the lock is held, one `ClaimRow` that stands for the invisible
    /// in-progress record (the request's own fingerprint, its lease).
    pub(super) transactional_claim: Statement<TransactionalClaim>,
    /// `$1` scope, `$2` key, `$3` owner, `$4` lease µs → rows updated.
    pub(super) renew: Statement<Renew>,
    /// `$1` scope, `$2` key, `$3` owner, `$4` status, `$5` headers, `$6` body,
    /// `$7` replayable, `$8` retention µs → rows updated.
    pub(super) complete: Statement<Complete>,
    /// The completion of transactional mode, as `complete`, but it fails
    /// (aborting the execution's transaction) when it updates no row, so that
    /// the `COMMIT` sent right behind it rolls back instead → one row.
    pub(super) transactional_complete: Statement<TransactionalComplete>,
    /// `COMMIT`, kept prepared: the end of a transactional execution,
    /// pipelined behind its completion.
    pub(super) commit: Statement<Commit>,
    /// `$1` scope, `$2` key, `$3` owner → rows deleted.
    pub(super) release: Statement<Release>,
    /// `$1` scope, `$2` key → zero or one `RecordRow`.
    pub(super) load: Statement<Load>,
    /// `$1` batch size → rows deleted.
    pub(super) delete_expired: Statement<DeleteExpired>,
    /// `$1` scope, `$2` key → one `InProgressRow`.
    pub(super) in_progress: Statement<InProgress>,
}

/// The columns of a `RecordRow`, read from the row alias `r`.
const RECORD_COLUMNS: &str = "r.fingerprint, r.state, uuid_send(r.owner) AS owner, \
    (extract(epoch FROM r.lease_until) * 1000000)::bigint AS lease_until, \
    r.status, r.headers, r.body, r.replayable, \
    (extract(epoch FROM r.expires_at) * 1000000)::bigint AS expires_at";

impl Statements {
    pub(super) fn new(table: &Table) -> Self {
        let t = table.sql();
        let keyed = *KEYED_TABLE.get_or_init(|| t.clone()) == t;
        let claimable = claimable("now()");
        let expired = expired("now()");
        let completion = format!(
            "state = '{COMPLETED}', owner = NULL, lease_until = NULL,
                status = $4, headers = $5, body = $6, replayable = $7,
                expires_at = now() + $8 * interval '1 microsecond'
             WHERE r.scope = $1 AND r.key = $2 AND r.owner = $3 AND r.state = '{IN_PROGRESS}'"
        );
        let upsert = format!(
            "{RECLAIM}
                    WHERE {claimable}
                    RETURNING {RECORD_COLUMNS}"
        );
        Self {
            // The gate runs first (a CTE with volatile functions is evaluated
            // once, before the statements that read it). When another
            // execution's transaction holds the key, its record is uncommitted
            // and invisible: the third branch answers in its place.
            transactional_claim: Statement::new(keyed, format!(
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
            )),
            // One statement, one round trip. A live record (one a claim would
            // not take: completed and unexpired, or in progress under its lease)
            // is returned as the statement's snapshot saw it, and nothing is
            // written: a replay only reads. Otherwise the upsert claims the new,
            // expired or lapsed record and returns it. The snapshot predates the
            // statement, so it misses a row another transaction committed while
            // the upsert waited on it: then neither branch returns a row and the
            // caller runs the statement again with a fresh snapshot.
            claim: Statement::new(keyed, format!(
                "WITH found AS (
                    SELECT {RECORD_COLUMNS} FROM {t} AS r
                    WHERE r.scope = $1 AND r.key = $2 AND NOT ({claimable})
                ), claimed AS (
                    INSERT INTO {t} AS r
                        (scope, key, fingerprint, state, owner, lease_until, expires_at, created_at)
                    SELECT $1, $2, $3, '{IN_PROGRESS}', $4,
                           now() + $5 * interval '1 microsecond',
                           now() + $6 * interval '1 microsecond', now()
                    WHERE NOT EXISTS (SELECT 1 FROM found)
                    {upsert}
                )
                SELECT true AS claimed, * FROM claimed
                UNION ALL
                SELECT false AS claimed, * FROM found"
            )),
            live: Statement::new(keyed, format!(
                "SELECT {RECORD_COLUMNS} FROM {t} AS r
                 WHERE r.scope = $1 AND r.key = $2 AND NOT ({claimable})"
            )),
            renew: Statement::new(keyed, format!(
                "UPDATE {t} AS r SET lease_until = now() + $4 * interval '1 microsecond'
                 WHERE r.scope = $1 AND r.key = $2 AND r.owner = $3 AND r.state = '{IN_PROGRESS}'"
            )),
            complete: Statement::new(keyed, format!("UPDATE {t} AS r SET {completion}")),
            // A missing record fails the statement at run time (the count is
            // not a constant, so the planner cannot fold the cast): PostgreSQL
            // has no RAISE outside PL/pgSQL.
            transactional_complete: Statement::new(keyed, format!(
                "WITH completed AS (UPDATE {t} AS r SET {completion} RETURNING 1)
                 SELECT CASE count(*) WHEN 1 THEN 1
                        ELSE ('idem: the in-progress record is missing, rows: ' || count(*))::integer
                        END AS completed
                 FROM completed"
            )),
            commit: Statement::new(keyed, "COMMIT".to_owned()),
            release: Statement::new(keyed, format!(
                "DELETE FROM {t} AS r
                 WHERE r.scope = $1 AND r.key = $2 AND r.owner = $3 AND r.state = '{IN_PROGRESS}'"
            )),
            load: Statement::new(keyed, format!(
                "SELECT {RECORD_COLUMNS} FROM {t} AS r
                 WHERE r.scope = $1 AND r.key = $2 AND NOT ({expired})"
            )),
            // `ctid = ANY(ARRAY(…))` is a TID scan: the batch is found through the
            // `expires_at` index and deleted by its physical address, without a
            // scan of the table. The outer condition is checked again on the row
            // version the delete meets, so a record claimed anew in between (a new
            // version) survives.
            delete_expired: Statement::new(keyed, format!(
                "DELETE FROM {t} AS r
                 WHERE r.ctid = ANY(ARRAY(
                     SELECT r.ctid FROM {t} AS r WHERE {expired} LIMIT $1))
                   AND {expired}"
            )),
            in_progress: Statement::new(keyed, format!(
                "SELECT EXISTS(
                     SELECT 1 FROM {t} AS r
                     WHERE r.scope = $1 AND r.key = $2
                       AND r.state = '{IN_PROGRESS}' AND r.lease_until > now()
                 ) AS in_progress"
            )),
        }
    }
}

/// The SQL text `sql` with every run of whitespace made one space: the text is
/// sent to the server once per connection, and copied on every execution.
fn compact(sql: &str) -> String {
    sql.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The one table whose statements are keyed by type in this process (see the
/// module docs).
static KEYED_TABLE: OnceLock<String> = OnceLock::new();

/// What keys a statement in the connections' statement caches: a type of its
/// own ([`Keyed`]), or its text ([`ByText`]).
pub(super) trait StatementKey: Any {
    /// Whether the cache key is this type rather than the text.
    const BY_TYPE: bool;
}

/// Keyed by its text (a statement of a table other than the keyed one).
pub(super) enum ByText {}

impl StatementKey for ByText {
    const BY_TYPE: bool = false;
}

macro_rules! statement_keys {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Debug)]
        pub(super) enum $name {}

        impl StatementKey for $name {
            const BY_TYPE: bool = true;
        }
    )*};
}

statement_keys!(
    /// The key of [`Statements::claim`].
    Claim,
    /// The key of [`Statements::live`].
    Live,
    /// The key of [`Statements::transactional_claim`].
    TransactionalClaim,
    /// The key of [`Statements::renew`].
    Renew,
    /// The key of [`Statements::complete`].
    Complete,
    /// The key of [`Statements::transactional_complete`].
    TransactionalComplete,
    /// The key of [`Statements::commit`].
    Commit,
    /// The key of [`Statements::release`].
    Release,
    /// The key of [`Statements::load`].
    Load,
    /// The key of [`Statements::delete_expired`].
    DeleteExpired,
    /// The key of [`Statements::in_progress`].
    InProgress,
    /// The consumer inbox's entry (see `consumer_inbox`).
    InboxEnter,
    /// The consumer inbox's last statement before `COMMIT`.
    InboxFinish,
    /// The consumer inbox's count of a failed attempt.
    InboxCount,
    /// The consumer inbox's move of a message to the dead letters.
    InboxBury,
    /// A partition's position, moved with a consumer inbox's entry.
    InboxAdvance,
    /// The consumer inbox's entry of a batch.
    InboxEnterBatch,
    /// The consumer inbox's last statement of a batch before `COMMIT`.
    InboxFinishBatch,
    /// The outbox's stage of an event (see `outbox`).
    OutboxStage,
    /// The outbox's stage of an event, without `NOTIFY`.
    OutboxStageQuiet,
    /// A relay's batch.
    OutboxTake,
    /// A relay's settlement of its batch.
    OutboxSettle,
);

/// One statement's text, and whether it is keyed by `K`.
pub(super) struct Statement<K> {
    sql: String,
    keyed: bool,
    key: PhantomData<fn() -> K>,
}

impl<K> std::fmt::Debug for Statement<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Statement")
            .field("sql", &self.sql)
            .field("keyed", &self.keyed)
            .finish()
    }
}

/// The binds of one execution: chain `.bind::<Type, _>(value)` on it, in the
/// order of the placeholders.
pub(super) fn binds() -> SqlQuery {
    diesel::sql_query(String::new())
}

impl<K: StatementKey> Statement<K> {
    /// The statement `sql`, cached by `K` when `keyed`, else by its text.
    pub(super) fn new(keyed: bool, sql: String) -> Self {
        Self {
            sql: compact(&sql),
            keyed,
            key: PhantomData,
        }
    }

    /// The statement's text.
    #[cfg(test)]
    pub(super) fn sql(&self) -> &str {
        &self.sql
    }

    /// Runs the statement with `binds` (see [`binds`]): its one row, if any.
    ///
    /// The connection is shared: statements run on one connection from
    /// futures polled together are pipelined (sent without waiting for the
    /// answers before them), in the order the futures are first polled.
    pub(super) async fn row<'a, B, R>(
        &'a self,
        connection: &AsyncPgConnection,
        binds: B,
    ) -> QueryResult<Option<R>>
    where
        B: QueryFragment<Pg> + Send + 'a,
        R: QueryableByName<Pg> + Send + 'static,
    {
        use diesel::OptionalExtension;
        let mut connection = connection;
        if self.keyed && K::BY_TYPE {
            Execution::<K, B>::new(&self.sql, binds)
                .get_result(&mut connection)
                .await
                .optional()
        } else {
            Execution::<ByText, B>::new(&self.sql, binds)
                .get_result(&mut connection)
                .await
                .optional()
        }
    }

    /// Runs the statement with `binds` (see [`binds`]): every row it answers.
    /// Pipelined as [`row`](Self::row) is.
    pub(super) async fn rows<'a, B, R>(
        &'a self,
        connection: &AsyncPgConnection,
        binds: B,
    ) -> QueryResult<Vec<R>>
    where
        B: QueryFragment<Pg> + Send + 'a,
        R: QueryableByName<Pg> + Send + 'static,
    {
        let mut connection = connection;
        if self.keyed && K::BY_TYPE {
            Execution::<K, B>::new(&self.sql, binds)
                .load(&mut connection)
                .await
        } else {
            Execution::<ByText, B>::new(&self.sql, binds)
                .load(&mut connection)
                .await
        }
    }

    /// Runs the statement with `binds` (see [`binds`]): the rows it changed.
    /// Pipelined as [`row`](Self::row) is.
    pub(super) async fn run<'a, B>(
        &'a self,
        connection: &AsyncPgConnection,
        binds: B,
    ) -> QueryResult<usize>
    where
        B: QueryFragment<Pg> + Send + 'a,
    {
        let mut connection = connection;
        if self.keyed && K::BY_TYPE {
            Execution::<K, B>::new(&self.sql, binds)
                .execute(&mut connection)
                .await
        } else {
            Execution::<ByText, B>::new(&self.sql, binds)
                .execute(&mut connection)
                .await
        }
    }
}

/// One execution of a fixed statement: its text, borrowed, and its binds.
pub(super) struct Execution<'a, K, B> {
    sql: &'a str,
    binds: B,
    key: PhantomData<fn() -> K>,
}

impl<'a, K, B> Execution<'a, K, B> {
    fn new(sql: &'a str, binds: B) -> Self {
        Self {
            sql,
            binds,
            key: PhantomData,
        }
    }
}

impl<K, B: QueryFragment<Pg>> QueryFragment<Pg> for Execution<'_, K, B> {
    fn walk_ast<'b>(&'b self, mut pass: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        // The binds' own text is empty.
        self.binds.walk_ast(pass.reborrow())?;
        pass.push_sql(self.sql);
        Ok(())
    }

    // A fixed text: the cache holds a handful of entries per connection.
    fn is_safe_to_cache_prepared(&self, _backend: &Pg) -> QueryResult<bool> {
        Ok(true)
    }
}

impl<K: StatementKey, B> QueryId for Execution<'_, K, B> {
    type QueryId = K;
    const HAS_STATIC_QUERY_ID: bool = K::BY_TYPE;
}

impl<K, B> Query for Execution<'_, K, B> {
    type SqlType = Untyped;
}

impl<K, B, Conn> diesel::RunQueryDsl<Conn> for Execution<'_, K, B> {}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_first_table_is_keyed_by_type_and_others_by_text() {
        let first = Table::new(None, "first_table").unwrap();
        let other = Table::new(Some("elsewhere"), "first_table").unwrap();
        let statements = Statements::new(&first);
        assert!(statements.claim.keyed && statements.complete.keyed);
        assert!(Statements::new(&first).live.keyed);
        let elsewhere = Statements::new(&other);
        assert!(!elsewhere.claim.keyed && !elsewhere.complete.keyed);
        assert!(
            elsewhere
                .claim
                .sql()
                .contains(r#"INSERT INTO "elsewhere"."first_table""#)
        );
    }

    #[test]
    fn texts_are_compact() {
        let statements = Statements::new(&Table::new(None, "first_table").unwrap());
        let claim = statements.claim.sql();
        assert!(!claim.contains('\n') && !claim.contains("  "), "{claim}");
        assert_eq!(
            compact("SELECT  1\n   FROM t\tWHERE x = '1 microsecond' "),
            "SELECT 1 FROM t WHERE x = '1 microsecond'"
        );
    }
}
