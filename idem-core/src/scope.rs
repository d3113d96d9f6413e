//! Who an idempotency key belongs to.

use std::fmt;
use std::sync::Arc;

/// The owner of a set of idempotency keys: a principal, a tenant, an API client.
///
/// Records are keyed by `(scope, key)`, so the same key sent by two scopes is two
/// records and neither scope ever sees the other's answer. The application sets the
/// scope from what it has authenticated; a header the client controls is never a
/// scope on its own, because any client could then read another client's answers.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(Arc<str>);

impl Scope {
    /// A scope named `name`.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self(name.into())
    }

    /// The scope of applications with a single tenant: the empty name.
    pub fn global() -> Self {
        Self(Arc::from(""))
    }

    /// The scope's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Scope {
    fn from(name: &str) -> Self {
        Self::new(name)
    }
}

impl From<String> for Scope {
    fn from(name: String) -> Self {
        Self::new(name)
    }
}
