//! A store that hands each execution a context, as a transactional store hands
//! its transaction: what the adapters' `StoreContext` tests extract.

use std::sync::Arc;

use idem_core::store::{Claim, ContextType, ExecutionContext, StoreLayer};
use idem_core::{MemoryStore, Store};

/// A [`MemoryStore`] that hands each execution a [`Till`] (see
/// [`Store::execution_context`]).
#[derive(Clone, Debug, Default)]
pub struct HandsATill(pub MemoryStore);

/// What [`HandsATill`] hands a handler.
#[derive(Debug)]
pub struct Till {
    /// Always [`Till::NAME`].
    pub name: &'static str,
}

impl Till {
    /// The name every till has.
    pub const NAME: &'static str = "the request's till";
}

impl StoreLayer for HandsATill {
    fn inner(&self) -> &dyn Store {
        &self.0
    }

    fn execution_context(&self, _: &Claim) -> Option<ExecutionContext> {
        Some(Arc::new(Till { name: Till::NAME }))
    }

    fn execution_context_type(&self) -> Option<ContextType> {
        Some(ContextType::of::<Till>())
    }
}

/// A [`MemoryStore`] that declares it hands a [`Till`] and hands none: a
/// store's bug, which the adapters' `on` answers `500 route-misconfigured`
/// without running the handler.
#[derive(Clone, Debug, Default)]
pub struct PromisesATill(pub MemoryStore);

impl StoreLayer for PromisesATill {
    fn inner(&self) -> &dyn Store {
        &self.0
    }

    fn execution_context_type(&self) -> Option<ContextType> {
        Some(ContextType::of::<Till>())
    }
}

/// Asserts that an answer is idem's `500 route-misconfigured` problem
/// (`docs/contract.md` §4): what a handler that takes a [`Till`] is answered
/// on a route whose store hands none.
///
/// # Panics
///
/// When it is not, saying what it is.
pub fn assert_route_misconfigured(status: u16, content_type: Option<&str>, body: &[u8]) {
    assert_eq!(status, 500, "{}", String::from_utf8_lossy(body));
    assert_eq!(content_type, Some(idem_core::PROBLEM_CONTENT_TYPE));
    let problem: serde_json::Value = serde_json::from_slice(body)
        .unwrap_or_else(|error| panic!("not JSON ({error}): {}", String::from_utf8_lossy(body)));
    assert_eq!(
        problem["type"],
        "https://idem.rs/problems/route-misconfigured"
    );
    assert_eq!(problem["title"], "The route is misconfigured");
    assert_eq!(problem["status"], 500);
    assert_eq!(
        problem["detail"],
        "this route's handler takes what idem's middleware did not give the request; the server's log says what"
    );
}
