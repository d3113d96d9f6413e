//! [`IdempotencyLayer`]: the middleware's configuration, and the Tower `Layer`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use idem_core::{
    Engine, FingerprintSpec, InProgress, KeyRequirement, OnStoreFailure, Policy, Scope,
    StatusFilter, Store,
};
use tower_layer::Layer;

use crate::Idempotency;

/// Applies [`Idempotency`] to a service: Stripe-style `Idempotency-Key` handling
/// over a [`Store`], with a [`Policy`].
///
/// Built with [`new`](Self::new) (keys required, every other default from the
/// contract) and consuming setters. Every setter changes the policy the layer's
/// services apply; [`policy`](Self::policy) replaces it whole.
///
/// ```
/// use std::time::Duration;
/// use axum::{Router, routing::post};
/// use idem_axum::IdempotencyLayer;
/// use idem_core::MemoryStore;
///
/// # #[derive(Clone)] struct Principal(String);
/// # impl From<Principal> for idem_core::Scope { fn from(p: Principal) -> Self { Self::new(p.0) } }
/// let store = MemoryStore::new();
/// let charges = IdempotencyLayer::new(store.clone())
///     .required()
///     .lease(Duration::from_secs(10))
///     .scope_from_extension::<Principal>();
/// let app: Router = Router::new().route("/charges", post(|| async { "charged" }).route_layer(charges));
/// ```
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    store: Arc<dyn Store>,
    policy: Policy,
    scope: ScopeSource,
}

/// Where a request's scope comes from.
#[derive(Clone)]
pub(crate) enum ScopeSource {
    Global,
    Resolve(Arc<ResolveScope>),
}

/// A function that names a request's scope from its head.
type ResolveScope = dyn Fn(&Parts) -> Option<Scope> + Send + Sync;

impl IdempotencyLayer {
    /// A layer over `store`: keys required, POST and PATCH covered, every limit
    /// and duration the contract's default, every request in the global scope.
    pub fn new(store: impl Store) -> Self {
        Self::from_shared(Arc::new(store))
    }

    /// A layer over a store already shared as `Arc<dyn Store>`.
    pub fn from_shared(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            policy: Policy::required(),
            scope: ScopeSource::Global,
        }
    }

    /// Keys are required: a covered request without one is answered
    /// `400 missing-key`. The default.
    pub fn required(self) -> Self {
        self.configure(|policy| policy.requirement(KeyRequirement::Required))
    }

    /// Keys are optional: a request without one passes through untouched.
    pub fn optional(self) -> Self {
        self.configure(|policy| policy.requirement(KeyRequirement::Optional))
    }

    /// Replaces the whole policy.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Changes the policy with its own setters.
    ///
    /// ```
    /// # use idem_axum::IdempotencyLayer;
    /// # use idem_core::{MemoryStore, StatusFilter};
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .configure(|policy| policy.stored_statuses(StatusFilter::new(|status| status < 300)));
    /// ```
    pub fn configure(mut self, change: impl FnOnce(Policy) -> Policy) -> Self {
        self.policy = change(self.policy);
        self
    }

    /// The methods covered (default POST and PATCH); other methods pass through.
    pub fn methods<I, M>(self, methods: I) -> Self
    where
        I: IntoIterator<Item = M>,
        M: AsRef<str>,
    {
        self.configure(|policy| policy.methods(methods))
    }

    /// How long a claim holds without renewal (default 30 s); it is renewed every
    /// third of it while the handler runs.
    pub fn lease(self, lease: Duration) -> Self {
        self.configure(|policy| policy.lease(lease))
    }

    /// How long completed records are kept (default 24 h).
    pub fn retention(self, retention: Duration) -> Self {
        self.configure(|policy| policy.retention(retention))
    }

    /// What a request does while another with its key runs (default `409` with
    /// `Retry-After: 1`).
    pub fn in_progress(self, behaviour: InProgress) -> Self {
        self.configure(|policy| policy.in_progress(behaviour))
    }

    /// Makes a request whose key is in progress wait up to `up_to` and replay
    /// the first request's answer (past the bound, `409`).
    pub fn wait_up_to(self, up_to: Duration) -> Self {
        self.in_progress(InProgress::Wait { up_to })
    }

    /// The largest request body accepted (default 1 MiB); over it, `413`.
    pub fn request_body_limit(self, bytes: usize) -> Self {
        self.configure(|policy| policy.request_body_limit(bytes))
    }

    /// The largest response body kept for replay (default 1 MiB). A larger one is
    /// still sent to the first client; retries get `410 response-not-stored`.
    pub fn stored_body_limit(self, bytes: usize) -> Self {
        self.configure(|policy| policy.stored_body_limit(bytes))
    }

    /// Which statuses are stored (default: below 500, except 408, 425, 429).
    pub fn stored_statuses(self, filter: StatusFilter) -> Self {
        self.configure(|policy| policy.stored_statuses(filter))
    }

    /// Fail closed (`503`, the default) or open when the store fails.
    pub fn on_store_failure(self, mode: OnStoreFailure) -> Self {
        self.configure(|policy| policy.on_store_failure(mode))
    }

    /// What the request fingerprint covers.
    pub fn fingerprint(self, spec: FingerprintSpec) -> Self {
        self.configure(|policy| policy.fingerprint(spec))
    }

    /// Scopes each request by the `T` an earlier middleware (authentication) put
    /// in its extensions. A request without one is answered
    /// `500 scope-unavailable`: the route is misconfigured, and answering in
    /// some other scope could show one client another's answer.
    pub fn scope_from_extension<T>(self) -> Self
    where
        T: Clone + Into<Scope> + Send + Sync + 'static,
    {
        self.scope_with(|parts| parts.extensions.get::<T>().cloned().map(Into::into))
    }

    /// Scopes each request by what `scope` finds in its head. `None` is answered
    /// `500 scope-unavailable`.
    ///
    /// Never return a raw header the client controls (an `X-Tenant-Id`): any client
    /// could then send another's value with a guessed key and read their answer.
    /// Return what authentication established.
    pub fn scope_with<F>(mut self, scope: F) -> Self
    where
        F: Fn(&Parts) -> Option<Scope> + Send + Sync + 'static,
    {
        self.scope = ScopeSource::Resolve(Arc::new(scope));
        self
    }

    /// The policy the layer's services apply.
    pub fn current_policy(&self) -> &Policy {
        &self.policy
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(
            inner,
            Engine::from_shared(Arc::clone(&self.store), self.policy.clone()),
            self.scope.clone(),
        )
    }
}

impl ScopeSource {
    pub(crate) fn resolve(&self, parts: &Parts) -> Option<Scope> {
        match self {
            Self::Global => Some(Scope::global()),
            Self::Resolve(resolve) => resolve(parts),
        }
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("policy", &self.policy)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for ScopeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Global => f.write_str("Global"),
            Self::Resolve(_) => f.write_str("Resolve(..)"),
        }
    }
}
