#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod engine;
mod fingerprint;
mod key;
mod policy;
mod problem;
mod response;
pub mod retry;
mod scope;
pub mod store;

#[cfg(feature = "test-util")]
pub mod conformance;

pub use engine::{Admission, Begin, Engine, Execution, Finished, Settlement};
pub use fingerprint::{
    BodyMode, Fingerprint, FingerprintBuilder, FingerprintSpec, HeaderSource, RequestHead,
};
pub use key::{IdempotencyKey, KEY_HEADER, KeyError, MAX_KEY_LEN, Redacted};
pub use policy::{
    InProgress, KeyRequirement, OnStoreFailure, Policy, ProblemStatuses, StatusFilter,
};
pub use problem::{PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_BASE, Problem, ProblemKind};
pub use response::{Header, REPLAYED_HEADER, StoredResponse};
pub use scope::Scope;
pub use store::{MemoryStore, Store, StoreError};
