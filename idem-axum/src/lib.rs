#![doc = include_str!("../README.md")]

mod answer;
mod body;
mod extract;
mod future;
mod layer;
mod on;
mod service;

pub use body::{RequestBody, ResponseBody};
pub use extract::{ExecutionInfo, NoIdempotencyKey, NoStoreContext, StoreContext};
pub use future::ResponseFuture;
pub use idem_core;
pub use idem_core::ContextRouteError;
pub use layer::IdempotencyLayer;
pub use on::{ContextHandler, HandlerFuture};
pub use service::Idempotency;
