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
        fmt::Debug::fmt(&crate::log::bounded(&self.0), f)
    }
}

/// Bounded, as logs show it ([`crate::log::bounded`]): an application may
/// derive a scope from what a request sends.
impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&crate::log::bounded(&self.0), f)
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

/// Where a route's scope comes from: the decision every route makes before it
/// serves a request (there is no default, so forgetting it cannot silently put
/// every client's keys in one space).
///
/// `R` is the framework's view of a request (`http::request::Parts` for Tower,
/// `HttpRequest` for actix-web); each adapter builds its sources with
/// constructors of its own (`scope_from_extension::<T>()`, `scope_with(..)`,
/// `global_scope()`) on top of [`ScopeSource::global`] and
/// [`ScopeSource::resolve_with`].
pub struct ScopeSource<R: ?Sized> {
    kind: SourceKind<R>,
}

enum SourceKind<R: ?Sized> {
    Global,
    Resolve {
        resolve: Arc<ResolveScope<R>>,
        expected: &'static str,
    },
}

/// A function that names a request's scope.
type ResolveScope<R> = dyn Fn(&R) -> Option<Scope> + Send + Sync;

/// The state of an adapter's builder before its scope is chosen. Such a builder
/// is not a middleware yet: it has no [`ChosenScope`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Unscoped;

/// A builder state whose scope source has been chosen. Implemented by
/// [`ScopeSource`] only; adapters make their middleware out of builders whose
/// state is a `ChosenScope`.
#[diagnostic::on_unimplemented(
    message = "this idempotency middleware has no scope yet",
    label = "the scope was never chosen",
    note = "choose where each request's scope comes from: `.scope_from_extension::<T>()` (set by your authentication), `.scope_with(|request| ..)`, or `.global_scope()` for a single-tenant application"
)]
pub trait ChosenScope<R: ?Sized> {
    /// The chosen source.
    fn source(&self) -> &ScopeSource<R>;
}

impl<R: ?Sized> ChosenScope<R> for ScopeSource<R> {
    fn source(&self) -> &ScopeSource<R> {
        self
    }
}

impl<R: ?Sized> ScopeSource<R> {
    /// Every request in [`Scope::global`]: for applications with a single tenant.
    pub fn global() -> Self {
        Self {
            kind: SourceKind::Global,
        }
    }

    /// Each request's scope is what `resolve` finds in it; `expected` says what
    /// it looks for (a type name, "the authenticated principal"), for the error
    /// logged when it finds nothing.
    pub fn resolve_with<F>(expected: &'static str, resolve: F) -> Self
    where
        F: Fn(&R) -> Option<Scope> + Send + Sync + 'static,
    {
        Self {
            kind: SourceKind::Resolve {
                resolve: Arc::new(resolve),
                expected,
            },
        }
    }

    /// The scope of `request`, or `None` when the source finds nothing.
    pub fn resolve(&self, request: &R) -> Option<Scope> {
        match &self.kind {
            SourceKind::Global => Some(Scope::global()),
            SourceKind::Resolve { resolve, .. } => resolve(request),
        }
    }

    /// What the source looks for, as given to [`resolve_with`](Self::resolve_with).
    pub fn expected(&self) -> &'static str {
        match &self.kind {
            SourceKind::Global => "the global scope",
            SourceKind::Resolve { expected, .. } => expected,
        }
    }
}

impl<R: ?Sized> Clone for ScopeSource<R> {
    fn clone(&self) -> Self {
        let kind = match &self.kind {
            SourceKind::Global => SourceKind::Global,
            SourceKind::Resolve { resolve, expected } => SourceKind::Resolve {
                resolve: Arc::clone(resolve),
                expected,
            },
        };
        Self { kind }
    }
}

impl<R: ?Sized> fmt::Debug for ScopeSource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            SourceKind::Global => f.write_str("ScopeSource::Global"),
            SourceKind::Resolve { expected, .. } => {
                write!(f, "ScopeSource::Resolve({expected})")
            }
        }
    }
}
