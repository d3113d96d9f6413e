#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod cleanup;
pub mod consume;
mod engine;
mod execution;
mod extract;
mod fingerprint;
mod key;
pub mod log;
mod metrics;
pub mod outbox;
mod policy;
mod problem;
pub mod protocol;
mod response;
pub mod retry;
mod scope;
pub mod store;

#[cfg(feature = "test-util")]
pub mod conformance;
#[cfg(feature = "test-util")]
pub mod faults;

pub use engine::{Begin, Engine, Execution, Settlement};
pub use execution::ExecutionInfo;
pub use extract::{ContextRouteError, NoIdempotencyKey, NoStoreContext, StoreContext};
pub use fingerprint::{
    BodyMode, Fingerprint, FingerprintHasher, FingerprintSpec, HeaderSource, RequestHead,
};
pub use key::{IdempotencyKey, KEY_HEADER, KeyError, MAX_KEY_LEN, Redacted};
pub use policy::{
    InProgress, KEYED_METHODS, KeyRequirement, OnStoreFailure, Policy, ProblemStatuses,
    StatusFilter,
};
pub use problem::{PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_BASE, Problem, ProblemKind};
pub use response::{Header, REPLAYED_HEADER, StoredResponse};

/// For adapter authors: what idem-axum and idem-actix use to turn their
/// framework's requests and answers into idem's and back. An application
/// needs none of it.
pub mod adapter {
    pub use crate::extract::store_context;
    pub use crate::response::{KEYED_REQUEST_HEADERS, keyed_request_header};
}
pub use scope::{ChosenScope, Scope, ScopeSource, Unscoped};
pub use store::{MemoryStore, Store, StoreError};
