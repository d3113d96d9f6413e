//! The extractor: what the middleware tells the handler of a keyed request it
//! let run. It is idem-core's own type (one `ExecutionInfo` for every
//! framework), an actix-web extractor through idem-core's feature `actix`.

/// What the middleware tells the handler of a keyed request it let run: the
/// key, the scope, whether the execution is guarded, what the store hands it,
/// whether its lease still holds: [`idem_core::ExecutionInfo`], an actix-web
/// extractor through idem-core's feature `actix`, which this crate turns on.
/// Its error is [`NoIdempotencyKey`] (`500`: the route is misconfigured).
///
/// Requests without a key (an optional route, an uncovered method) carry no
/// `ExecutionInfo`: extract `Option<ExecutionInfo>` there.
///
/// ```
/// use actix_web::HttpResponse;
/// use idem_actix::ExecutionInfo;
///
/// async fn charge(execution: ExecutionInfo) -> HttpResponse {
///     HttpResponse::Created().body(format!("charging once for key {}", execution.key().redacted()))
/// }
/// # let _ = actix_web::web::post().to(charge);
/// ```
pub use idem_core::{ExecutionInfo, NoIdempotencyKey, NoStoreContext, StoreContext};
