#![doc = include_str!("../README.md")]

mod capture;
mod closing;
mod edge;
mod extract;
mod future;
mod middleware;
mod on;

pub use extract::{ExecutionInfo, NoIdempotencyKey, NoStoreContext, StoreContext};
#[doc(hidden)]
pub use future::IdempotencyFuture;
pub use idem_core;
pub use idem_core::ContextRouteError;
pub use middleware::Idempotency;
#[doc(hidden)]
pub use middleware::IdempotencyMiddleware;
pub use on::ContextHandler;
