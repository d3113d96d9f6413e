//! The axum extractor: what the middleware tells the handler it let through.
//! It is idem-core's own type (one `ExecutionInfo` for every framework),
//! an axum extractor through idem-core's feature `axum`.

/// What the middleware tells the handler of a keyed request it let run: the
/// key, the scope, whether the execution is guarded, what the store hands it,
/// whether its lease still holds: [`idem_core::ExecutionInfo`], an axum
/// extractor (on axum-core) through idem-core's feature `axum`, which this
/// crate turns on. Its rejection is [`NoIdempotencyKey`] (`500`: the route is
/// misconfigured).
///
/// Requests without a key (an optional route, an uncovered method) carry no
/// `ExecutionInfo`: extract `Option<ExecutionInfo>` there.
///
/// ```
/// use idem_axum::ExecutionInfo;
///
/// async fn charge(execution: ExecutionInfo) -> String {
///     format!("charging once for key {}", execution.key().redacted())
/// }
/// # let _: axum::routing::MethodRouter = axum::routing::post(charge);
/// ```
///
/// With idem-diesel's transactional store, the handler states that it takes
/// the request's transaction (a [`StoreContext`], named
/// `idem_diesel::Transaction`) as its first argument and is mounted with
/// [`IdempotencyLayer::on`](crate::IdempotencyLayer::on), which checks as the
/// route is built that every request it sees has one; its writes commit with
/// the record:
///
/// ```no_run
/// use axum::Router;
/// use axum::http::{Method, StatusCode};
/// use idem_axum::{ContextRouteError, IdempotencyLayer};
/// use idem_core::Policy;
/// use idem_diesel::{PgStore, Transaction};
///
/// async fn charge(transaction: Transaction, body: String) -> StatusCode {
///     let Ok(connection) = transaction.connection().await else {
///         return StatusCode::SERVICE_UNAVAILABLE;
///     };
///     // … diesel-async writes on `&mut *connection`, committed with the answer.
///     drop(connection);
///     StatusCode::CREATED
/// }
///
/// fn app(store: &PgStore) -> Result<Router, ContextRouteError> {
///     let charges = IdempotencyLayer::new(store.transactional(), Policy::required()).global_scope();
///     Ok(Router::new().route("/charges", charges.on(Method::POST, charge)?))
/// }
/// ```
pub use idem_core::{ExecutionInfo, NoIdempotencyKey, NoStoreContext, StoreContext};
