//! A store that hands each execution a context, as a transactional store hands
//! its transaction: what the adapters' `StoreContext` tests extract.

use std::sync::Arc;

use idem_core::store::{Claim, ExecutionContext, StoreLayer};
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
}
