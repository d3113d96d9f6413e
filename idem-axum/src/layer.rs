//! [`IdempotencyLayer`]: the middleware's configuration, and the Tower `Layer`.

use http::request::Parts;
use idem_core::{ChosenScope, Engine, Policy, Scope, ScopeSource, Store, Unscoped};
use tower_layer::Layer;

use crate::Idempotency;

/// Applies [`Idempotency`] to a service: Stripe-style `Idempotency-Key` handling
/// over a [`Store`], with a [`Policy`] (every setting, each with its default, is
/// a setter of `Policy`).
///
/// A layer is made in two steps: [`new`](Self::new) with the store and the
/// policy, then the choice of where each request's scope comes from
/// ([`scope_from_extension`](Self::scope_from_extension),
/// [`scope_with`](Self::scope_with) or [`global_scope`](Self::global_scope)).
/// Until the scope is chosen it is not a `Layer`, so a route cannot silently
/// share one key space between all its clients: forgetting it is a compile
/// error.
///
/// The scope usually comes from authentication, so the layer that
/// authenticates must run first: add it *after* this one with
/// `Router::layer`/`route_layer` (axum applies the last layer added
/// outermost), or on an enclosing router.
///
/// ```
/// use std::time::Duration;
/// use axum::{Router, routing::post};
/// use idem_axum::IdempotencyLayer;
/// use idem_core::{MemoryStore, Policy};
///
/// # #[derive(Clone)] struct Principal(String);
/// # impl From<Principal> for idem_core::Scope { fn from(p: Principal) -> Self { Self::new(p.0) } }
/// let store = MemoryStore::new();
/// let charges = IdempotencyLayer::new(store.clone(), Policy::required().lease(Duration::from_secs(10)))
///     .scope_from_extension::<Principal>();
/// let app: Router = Router::new().route("/charges", post(|| async { "charged" }).route_layer(charges));
/// ```
///
/// Without a scope, the layer is refused where it is used:
///
/// ```compile_fail
/// # use axum::{Router, routing::post};
/// # use idem_axum::IdempotencyLayer;
/// # use idem_core::{MemoryStore, Policy};
/// let unscoped = IdempotencyLayer::new(MemoryStore::new(), Policy::required());
/// let app: Router = Router::new().route("/charges", post(|| async { "charged" }).route_layer(unscoped));
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct IdempotencyLayer<Sc = ScopeSource<Parts>> {
    engine: Engine,
    scope: Sc,
}

impl IdempotencyLayer<Unscoped> {
    /// A layer over `store` applying `policy`; its scope is still to be chosen.
    ///
    /// # Panics
    ///
    /// When the store is not ready ([`Engine::new`]: idem-diesel's stores
    /// before `migrate()` or `check_schema()`), with the fix in the message.
    /// `from_engine(Engine::try_new(store, policy)?)` answers it as a
    /// `Result` instead.
    pub fn new(store: impl Store, policy: Policy) -> Self {
        Self::from_engine(Engine::new(store, policy))
    }

    /// A layer over `engine` (its store and policy); its scope is still to be
    /// chosen. For a store already shared as `Arc<dyn Store>`,
    /// [`Engine::from_shared`] builds the engine without wrapping it again.
    pub fn from_engine(engine: Engine) -> Self {
        Self {
            engine,
            scope: Unscoped,
        }
    }
}

impl<Sc> IdempotencyLayer<Sc> {
    /// Scopes each request by the `T` an earlier middleware (authentication) put
    /// in its extensions. A request without one is answered
    /// `500 scope-unavailable` and logged at error level with `T`'s name: the
    /// route is misconfigured (most often the authentication layer runs inside
    /// this one), and answering in some other scope could show one client
    /// another's answer.
    pub fn scope_from_extension<T>(self) -> IdempotencyLayer
    where
        T: Clone + Into<Scope> + Send + Sync + 'static,
    {
        self.scope(ScopeSource::resolve_with(
            std::any::type_name::<T>(),
            |parts: &Parts| parts.extensions.get::<T>().cloned().map(Into::into),
        ))
    }

    /// Scopes each request by what `scope` finds in its head. `None` is answered
    /// `500 scope-unavailable`.
    ///
    /// Never return a raw header the client controls (an `X-Tenant-Id`): any client
    /// could then send another's value with a guessed key and read their answer.
    /// Return what authentication established.
    pub fn scope_with<F>(self, scope: F) -> IdempotencyLayer
    where
        F: Fn(&Parts) -> Option<Scope> + Send + Sync + 'static,
    {
        self.scope(ScopeSource::resolve_with(
            "the scope_with function's scope",
            scope,
        ))
    }

    /// Every request in [`Scope::global`]: one key space for all clients, for
    /// applications with a single tenant.
    pub fn global_scope(self) -> IdempotencyLayer {
        self.scope(ScopeSource::global())
    }

    fn scope(self, scope: ScopeSource<Parts>) -> IdempotencyLayer {
        IdempotencyLayer {
            engine: self.engine,
            scope,
        }
    }

    /// The engine: its store and policy.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

impl<S, Sc: ChosenScope<Parts>> Layer<S> for IdempotencyLayer<Sc> {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.engine.clone(), self.scope.source().clone())
    }
}
