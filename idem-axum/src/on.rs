//! [`IdempotencyLayer::on`]: a handler that takes what the store hands it,
//! mounted with the layer around it, checked when the route is built.

use std::future::{Future, ready};
use std::pin::Pin;

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::handler::Handler;
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter};
use http::request::Parts;
use idem_core::adapter::store_context;
use idem_core::{ChosenScope, ContextRouteError, ExecutionInfo, StoreContext};

use crate::IdempotencyLayer;

/// The future a [`ContextHandler`] runs: axum's own handlers' shape.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Response> + Send>>;

/// An async function whose first argument is a [`StoreContext<C>`] and whose
/// others are axum extractors (the last may take the body), as many as
/// axum's own handlers take: what [`IdempotencyLayer::on`] mounts. `T` and
/// `S` are axum's: the extractors' types and the router's state.
pub trait ContextHandler<C, T, S>: Clone + Send + Sync + Sized + 'static {
    /// Runs the handler on `request` with `context`.
    fn call(self, context: StoreContext<C>, request: Request, state: S) -> HandlerFuture;
}

impl<F, Fut, Res, C, S> ContextHandler<C, ((),), S> for F
where
    F: FnOnce(StoreContext<C>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Res> + Send,
    Res: IntoResponse,
    C: Send + Sync + 'static,
    S: Send + Sync + 'static,
{
    fn call(self, context: StoreContext<C>, request: Request, state: S) -> HandlerFuture {
        Handler::<((),), S>::call(move || self(context), request, state)
    }
}

/// `ContextHandler` for functions taking the context and `$rest` (the last
/// extractor may take the body), through axum's `Handler` for the closure
/// that hands the function its context.
macro_rules! context_handler {
    ($($parts:ident),* ; $last:ident) => {
        #[allow(non_snake_case)]
        impl<F, Fut, Res, C, S, M, $($parts,)* $last> ContextHandler<C, (M, $($parts,)* $last,), S> for F
        where
            F: FnOnce(StoreContext<C>, $($parts,)* $last) -> Fut + Clone + Send + Sync + 'static,
            Fut: Future<Output = Res> + Send,
            Res: IntoResponse,
            C: Send + Sync + 'static,
            S: Send + Sync + 'static,
            $($parts: FromRequestParts<S> + Send,)*
            $last: FromRequest<S, M> + Send,
        {
            fn call(self, context: StoreContext<C>, request: Request, state: S) -> HandlerFuture {
                let handler = move |$($parts: $parts,)* $last: $last| self(context, $($parts,)* $last);
                Handler::<(M, $($parts,)* $last,), S>::call(handler, request, state)
            }
        }
    };
}

context_handler!(; T1);
context_handler!(T1; T2);
context_handler!(T1, T2; T3);
context_handler!(T1, T2, T3; T4);
context_handler!(T1, T2, T3, T4; T5);
context_handler!(T1, T2, T3, T4, T5; T6);
context_handler!(T1, T2, T3, T4, T5, T6; T7);
context_handler!(T1, T2, T3, T4, T5, T6, T7; T8);
context_handler!(T1, T2, T3, T4, T5, T6, T7, T8; T9);
context_handler!(T1, T2, T3, T4, T5, T6, T7, T8, T9; T10);
context_handler!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10; T11);
context_handler!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11; T12);
context_handler!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11, T12; T13);
context_handler!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11, T12, T13; T14);
context_handler!(T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11, T12, T13, T14; T15);

/// A [`ContextHandler`] as axum's `Handler`: hands it the context the layer
/// put in the request's [`ExecutionInfo`].
#[derive(Clone)]
struct WithContext<H>(H);

/// Its `T` (axum's marker of a handler's arguments) names the context too.
impl<H, C, T, S> Handler<(StoreContext<C>, T), S> for WithContext<H>
where
    H: ContextHandler<C, T, S>,
    C: Send + Sync + 'static,
    S: Send + Sync + 'static,
{
    type Future = HandlerFuture;

    fn call(self, request: Request, state: S) -> HandlerFuture {
        match store_context::<C>(request.extensions().get::<ExecutionInfo>()) {
            Ok(context) => self.0.call(context, request, state),
            // Only a store that declares a `C` and hands none comes here.
            Err(refused) => Box::pin(ready(refused.into_response())),
        }
    }
}

impl<Sc> IdempotencyLayer<Sc>
where
    Sc: ChosenScope<Parts> + Clone + Send + Sync + 'static,
{
    /// `handler`, which takes a [`StoreContext<C>`] first (idem-diesel's
    /// `Transaction`), mounted on `method` with this layer around it: the
    /// one way to mount such a handler, since `StoreContext` is no extractor
    /// on its own. Chain the route's other methods on the answer, as on any
    /// `MethodRouter`.
    ///
    /// Checked here, when the route is built ([`idem_core::Engine::check_context`]):
    /// the store hands a `C`, keys are required, the route fails closed and
    /// the policy covers `method`. Otherwise the answer is the
    /// [`ContextRouteError`] saying what to change, and the application
    /// fails to start instead of answering requests `500`.
    ///
    /// ```
    /// use axum::{http::Method, routing::MethodRouter};
    /// use idem_axum::{IdempotencyLayer, StoreContext};
    /// use idem_core::{ContextRouteError, MemoryStore, Policy};
    ///
    /// struct Till;
    ///
    /// async fn charge(till: StoreContext<Till>, body: String) -> &'static str {
    ///     "charged"
    /// }
    ///
    /// // The in-memory store hands no till: refused as the route is built.
    /// let charges = IdempotencyLayer::new(MemoryStore::new(), Policy::required()).global_scope();
    /// let refused: Result<MethodRouter, _> = charges.on(Method::POST, charge);
    /// assert!(matches!(refused, Err(ContextRouteError::NotHanded { handed: None, .. })));
    /// ```
    ///
    /// Mounted as a plain handler, it does not compile:
    ///
    /// ```compile_fail
    /// use axum::{Router, routing::post};
    /// use idem_axum::StoreContext;
    ///
    /// struct Till;
    ///
    /// async fn charge(till: StoreContext<Till>) -> &'static str {
    ///     "charged"
    /// }
    ///
    /// let app: Router = Router::new().route("/charges", post(charge));
    /// ```
    pub fn on<C, H, T, S>(
        &self,
        method: Method,
        handler: H,
    ) -> Result<MethodRouter<S>, ContextRouteError>
    where
        H: ContextHandler<C, T, S>,
        C: Send + Sync + 'static,
        T: 'static,
        S: Clone + Send + Sync + 'static,
    {
        self.engine().check_context::<C>(method.as_str())?;
        let filter = MethodFilter::try_from(method.clone()).map_err(|_| {
            ContextRouteError::UnroutableMethod {
                method: method.to_string(),
            }
        })?;
        Ok(axum::routing::on(
            filter,
            WithContext(handler).layer(self.clone()),
        ))
    }
}
