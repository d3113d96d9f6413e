//! [`Idempotency::on`]: a handler that takes what the store hands it,
//! mounted with the middleware around it, checked when the route is built.

use std::future::{Future, Ready, ready};

use actix_web::dev::Payload;
use actix_web::http::Method;
use actix_web::{FromRequest, Handler, HttpMessage, HttpRequest, Responder, Route, web};
use idem_core::adapter::store_context;
use idem_core::{ChosenScope, ContextRouteError, ExecutionInfo, NoStoreContext, StoreContext};

use crate::Idempotency;

/// An async function whose first argument is a [`StoreContext<C>`] and whose
/// others are actix-web extractors, as many as actix-web's own handlers
/// take: what [`Idempotency::on`] mounts. `Args` is the tuple of the
/// extractors after the context.
pub trait ContextHandler<C, Args>: Clone + 'static {
    /// What the handler answers.
    type Output;
    /// The handler's future.
    type Future: Future<Output = Self::Output>;

    /// Runs the handler with `context` and the extracted `args`.
    fn call(&self, context: StoreContext<C>, args: Args) -> Self::Future;
}

/// `ContextHandler` for functions taking the context and `$args`.
macro_rules! context_handler {
    ($($args:ident),*) => {
        #[allow(non_snake_case)]
        impl<F, Fut, C, $($args,)*> ContextHandler<C, ($($args,)*)> for F
        where
            F: Fn(StoreContext<C>, $($args,)*) -> Fut + Clone + 'static,
            Fut: Future,
        {
            type Output = Fut::Output;
            type Future = Fut;

            fn call(&self, context: StoreContext<C>, ($($args,)*): ($($args,)*)) -> Fut {
                self(context, $($args,)*)
            }
        }
    };
}

context_handler!();
context_handler!(A1);
context_handler!(A1, A2);
context_handler!(A1, A2, A3);
context_handler!(A1, A2, A3, A4);
context_handler!(A1, A2, A3, A4, A5);
context_handler!(A1, A2, A3, A4, A5, A6);
context_handler!(A1, A2, A3, A4, A5, A6, A7);
context_handler!(A1, A2, A3, A4, A5, A6, A7, A8);
context_handler!(A1, A2, A3, A4, A5, A6, A7, A8, A9);
context_handler!(A1, A2, A3, A4, A5, A6, A7, A8, A9, A10);
context_handler!(A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11);
context_handler!(A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12);
context_handler!(A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13);
context_handler!(A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13, A14);
context_handler!(
    A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13, A14, A15
);

/// The context the middleware put in the request's [`ExecutionInfo`], as
/// the first of a [`WithContext`]'s extractors.
struct Context<C>(StoreContext<C>);

impl<C: Send + Sync + 'static> FromRequest for Context<C> {
    // Only a store that declares a `C` and hands none is refused.
    type Error = NoStoreContext;
    type Future = Ready<Result<Self, NoStoreContext>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(store_context(request.extensions().get::<ExecutionInfo>()).map(Context))
    }
}

/// A [`ContextHandler`] as actix-web's `Handler`.
#[derive(Clone)]
struct WithContext<H>(H);

impl<H, C, Args> Handler<(Context<C>, Args)> for WithContext<H>
where
    H: ContextHandler<C, Args>,
    C: 'static,
{
    type Output = H::Output;
    type Future = H::Future;

    fn call(&self, (Context(context), args): (Context<C>, Args)) -> H::Future {
        self.0.call(context, args)
    }
}

impl<Sc> Idempotency<Sc>
where
    Sc: ChosenScope<HttpRequest> + Clone + 'static,
{
    /// A route on `method` to `handler`, which takes a [`StoreContext<C>`]
    /// first (idem-diesel's `Transaction`), with this middleware around it:
    /// the one way to mount such a handler, since `StoreContext` is no
    /// extractor on its own. Add the route to a resource
    /// (`web::resource(path).route(..)`); authentication registered on the
    /// resource, scope or app runs before it.
    ///
    /// Checked here, when the route is built ([`idem_core::Engine::check_context`]):
    /// the store hands a `C`, keys are required, the route fails closed and
    /// the policy covers `method`. Otherwise the answer is the
    /// [`ContextRouteError`] saying what to change, and the application
    /// fails to start instead of answering requests `500`.
    ///
    /// ```
    /// use actix_web::{HttpResponse, http::Method};
    /// use idem_actix::{Idempotency, StoreContext};
    /// use idem_core::{ContextRouteError, MemoryStore, Policy};
    ///
    /// struct Till;
    ///
    /// async fn charge(till: StoreContext<Till>, body: String) -> HttpResponse {
    ///     HttpResponse::Created().finish()
    /// }
    ///
    /// // The in-memory store hands no till: refused as the route is built.
    /// let charges = Idempotency::new(MemoryStore::new(), Policy::required()).global_scope();
    /// let refused = charges.on(Method::POST, charge);
    /// assert!(matches!(refused, Err(ContextRouteError::NotHanded { handed: None, .. })));
    /// ```
    ///
    /// Mounted as a plain handler, it does not compile:
    ///
    /// ```compile_fail
    /// use actix_web::{HttpResponse, web};
    /// use idem_actix::StoreContext;
    ///
    /// struct Till;
    ///
    /// async fn charge(till: StoreContext<Till>) -> HttpResponse {
    ///     HttpResponse::Created().finish()
    /// }
    ///
    /// let route = web::post().to(charge);
    /// ```
    pub fn on<C, H, Args>(&self, method: Method, handler: H) -> Result<Route, ContextRouteError>
    where
        H: ContextHandler<C, Args>,
        H::Output: Responder + 'static,
        C: Send + Sync + 'static,
        Args: FromRequest + 'static,
    {
        self.engine().check_context::<C>(method.as_str())?;
        Ok(web::method(method)
            .to(WithContext(handler))
            .wrap(self.clone()))
    }
}
