#![doc = include_str!("../README.md")]

mod capture;
mod closing;
mod edge;
mod extract;
mod future;
mod middleware;

pub use extract::{ExecutionInfo, NoIdempotencyKey, NoStoreContext, StoreContext};
#[doc(hidden)]
pub use future::IdempotencyFuture;
pub use idem_core;
pub use middleware::Idempotency;
#[doc(hidden)]
pub use middleware::IdempotencyMiddleware;
