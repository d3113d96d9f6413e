//! Statements the connection keeps prepared.
//!
//! diesel never caches a `sql_query` as a prepared statement, since its text
//! could be built anew for every call: on PostgreSQL every execution would then
//! cost two round trips (prepare, then execute). The stores' statements are fixed
//! for the life of the store (only the table name is spliced in, once), so they
//! are marked cacheable: the connection prepares each one once, keyed by its
//! text, and every later execution is one round trip.

use diesel::QueryResult;
use diesel::backend::Backend;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};

/// A `sql_query` (with its binds) whose text never changes, so that connections
/// may keep it prepared.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Prepared<Q>(pub(crate) Q);

impl<Q, DB> QueryFragment<DB> for Prepared<Q>
where
    Q: QueryFragment<DB>,
    DB: Backend,
{
    fn walk_ast<'b>(&'b self, pass: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        self.0.walk_ast(pass)
    }

    // The text is one of a store's fixed statements, so the cache holds a handful
    // of entries per connection.
    fn is_safe_to_cache_prepared(&self, _backend: &DB) -> QueryResult<bool> {
        Ok(true)
    }
}

/// No static id: the cache keys the statement by its text and bind types.
impl<Q> QueryId for Prepared<Q> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q: Query> Query for Prepared<Q> {
    type SqlType = Q::SqlType;
}

impl<Q, Conn> diesel::RunQueryDsl<Conn> for Prepared<Q> {}

/// `.prepared()` on a `sql_query` chain.
pub(crate) trait PreparedExt: Sized {
    /// Marks the statement as one the connection may keep prepared.
    fn prepared(self) -> Prepared<Self> {
        Prepared(self)
    }
}

impl<T> PreparedExt for T {}
