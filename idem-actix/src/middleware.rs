//! The middleware: [`Idempotency`], a `Transform`, and the hidden service it wraps
//! a resource or scope in.

use std::future::{Ready, ready};
use std::rc::Rc;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Payload, Service, ServiceRequest, ServiceResponse, Transform, forward_ready};
use actix_web::http::header::CONTENT_LENGTH;
use actix_web::{Error, HttpMessage, HttpRequest};
use bytes::Bytes;
use idem_core::protocol::{Handled, Keyed, Outcome, Remnant, Start};
use idem_core::{
    ChosenScope, Engine, ExecutionInfo, Policy, RequestHead, Scope, ScopeSource, Store,
    StoredResponse, Unscoped,
};

use crate::capture::{delivered_body, handler_body};
use crate::closing;
use crate::edge::{AnswerError, RequestHeaders, into_http_response, stored_headers};
use crate::future::{Answer, IdempotencyFuture};

/// Makes a resource or scope safe to retry: wraps it so that requests with the same
/// `Idempotency-Key` run the handler once and replay its answer.
///
/// Made in two steps: [`new`](Self::new) with the store and the [`Policy`]
/// (every setting, each with its default, is a setter of `Policy`), then the
/// choice of where each request's scope comes from
/// ([`scope_from_extension`](Self::scope_from_extension),
/// [`scope_with`](Self::scope_with) or [`global_scope`](Self::global_scope)).
/// Until the scope is chosen it is not a `Transform`, so forgetting it is a
/// compile error rather than one key space shared by every client. Nothing is
/// looked up from `app_data` at request time.
///
/// The scope usually comes from authentication, which must then run first:
/// register it on the enclosing `App` or `web::scope`, or `wrap` it after this
/// one on the same resource (actix runs the last `wrap` outermost).
///
/// ```
/// use actix_web::{App, HttpResponse, web};
/// use idem_actix::Idempotency;
/// use idem_core::{MemoryStore, Policy};
///
/// let store = MemoryStore::new();
/// let app = App::new().service(
///     web::resource("/charges")
///         .wrap(Idempotency::new(store.clone(), Policy::required()).global_scope())
///         .route(web::post().to(|| async { HttpResponse::Created().finish() })),
/// );
/// # drop(app);
/// ```
///
/// Without a scope, the middleware is refused where it is used:
///
/// ```compile_fail
/// # use actix_web::{App, HttpResponse, web};
/// # use idem_actix::Idempotency;
/// # use idem_core::{MemoryStore, Policy};
/// let app = App::new().service(
///     web::resource("/charges")
///         .wrap(Idempotency::new(MemoryStore::new(), Policy::required()))
///         .route(web::post().to(|| async { HttpResponse::Created().finish() })),
/// );
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct Idempotency<Sc = ScopeSource<HttpRequest>> {
    engine: Engine,
    scope: Sc,
}

impl Idempotency<Unscoped> {
    /// Idempotency over `store` applying `policy`; its scope is still to be
    /// chosen.
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

    /// Idempotency over `engine` (its store and policy); its scope is still
    /// to be chosen. For a store already shared as `Arc<dyn Store>`,
    /// [`Engine::from_shared`] builds the engine without wrapping it again.
    pub fn from_engine(engine: Engine) -> Self {
        Self {
            engine,
            scope: Unscoped,
        }
    }
}

impl<Sc> Idempotency<Sc> {
    /// Scopes each request by the `T` an earlier middleware (authentication) put
    /// in its extensions. A request without one is answered
    /// `500 scope-unavailable` and logged at error level with `T`'s name: the
    /// route is misconfigured (most often the authentication middleware runs
    /// inside this one), and answering in some other scope could show one
    /// client another's answer.
    pub fn scope_from_extension<T>(self) -> Idempotency
    where
        T: Clone + Into<Scope> + 'static,
    {
        self.scope(ScopeSource::resolve_with(
            std::any::type_name::<T>(),
            |request: &HttpRequest| request.extensions().get::<T>().cloned().map(Into::into),
        ))
    }

    /// Scopes each request by what `scope` finds in it, before its body is read.
    /// `None` is answered `500 scope-unavailable` and the handler does not run.
    ///
    /// Never return a raw header the client controls (an `X-Tenant-Id`): any
    /// client could then send another's value with a guessed key and read their
    /// answer. Return what authentication established.
    pub fn scope_with<F>(self, scope: F) -> Idempotency
    where
        F: Fn(&HttpRequest) -> Option<Scope> + Send + Sync + 'static,
    {
        self.scope(ScopeSource::resolve_with(
            "the scope_with function's scope",
            scope,
        ))
    }

    /// Every request in [`Scope::global`]: one key space for all clients, for
    /// applications with a single tenant.
    pub fn global_scope(self) -> Idempotency {
        self.scope(ScopeSource::global())
    }

    fn scope(self, scope: ScopeSource<HttpRequest>) -> Idempotency {
        Idempotency {
            engine: self.engine,
            scope,
        }
    }

    /// The engine: its store and policy.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

impl<S, B, Sc> Transform<S, ServiceRequest> for Idempotency<Sc>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
    Sc: ChosenScope<HttpRequest>,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Transform = IdempotencyMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(IdempotencyMiddleware {
            service: Rc::new(service),
            engine: self.engine.clone(),
            scope: self.scope.source().clone(),
        }))
    }
}

/// The service [`Idempotency`] wraps a resource in. Not used directly.
#[doc(hidden)]
pub struct IdempotencyMiddleware<S> {
    service: Rc<S>,
    engine: Engine,
    scope: ScopeSource<HttpRequest>,
}

impl<S, B> Service<ServiceRequest> for IdempotencyMiddleware<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Future = IdempotencyFuture<S::Future, B>;

    forward_ready!(service);

    fn call(&self, request: ServiceRequest) -> Self::Future {
        let head = RequestHead {
            method: request.method().as_str(),
            path: request.path(),
            query: request.query_string(),
            headers: &RequestHeaders(request.headers()),
        };
        match self.engine.start(&head, &self.scope, request.request()) {
            Start::PassThrough => IdempotencyFuture::pass_through(self.service.call(request)),
            Start::Answer(answer) => IdempotencyFuture::answered(answered(request, answer)),
            Start::Keyed(keyed) => IdempotencyFuture::keyed(Box::pin(respond(
                Rc::clone(&self.service),
                keyed,
                request,
            ))),
        }
    }
}

/// Hands a keyed request to the protocol; the handler runs to completion even
/// if the client goes away (actix drops this future then).
async fn respond<S, B>(service: Rc<S>, keyed: Keyed, mut request: ServiceRequest) -> Answer<B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse().ok());
    let payload = request.take_payload();
    let handler = move |mut request: ServiceRequest, body: Bytes, info: ExecutionInfo| async move {
        request.set_payload(Payload::from(body));
        request.extensions_mut().insert(info);
        let (request, response) = service.call(request).await?.into_parts();
        let (head, body) = response.into_parts();
        Ok::<_, Error>(Handled {
            status: head.status().as_u16(),
            headers: stored_headers(head.headers()),
            body: handler_body(body),
            head: (request, head),
        })
    };
    match keyed
        .respond_local(request, declared, payload, handler)
        .await
    {
        Outcome::Deliver {
            head: (request, head),
            body,
        } => Ok(ServiceResponse::new(
            request,
            head.set_body(delivered_body(body)),
        )),
        Outcome::Answer {
            answer,
            remnant: Remnant::Request { kept, body },
        } => Ok(refused(kept, answer, body)),
        Outcome::Answer {
            answer,
            remnant: Remnant::Handled((request, _)),
        } => Ok(answered_to(request, answer)),
        // The request went down with the handler: the answer travels as an
        // error, which actix answers with its response.
        Outcome::Answer {
            answer,
            remnant: Remnant::Lost,
        } => Err(AnswerError(answer).into()),
        Outcome::Failed(error) => Err(error),
    }
}

/// An answer sent before the handler ran: a replay, or a refusal. A body read
/// to its end is answered as usual; one left unread (`413`, `408`, `400`)
/// closes the connection after the answer, where actix-web would otherwise
/// read on (see `closing`).
fn refused<B>(
    request: ServiceRequest,
    answer: StoredResponse,
    mut payload: Payload,
) -> ServiceResponse<EitherBody<B>> {
    if closing::is_finished(&mut payload) {
        return answered(request, answer);
    }
    request
        .into_response(closing::closing_answer(answer, payload))
        .map_into_right_body()
}

fn answered<B>(request: ServiceRequest, answer: StoredResponse) -> ServiceResponse<EitherBody<B>> {
    request
        .into_response(into_http_response(answer))
        .map_into_right_body()
}

/// `answer`, sent in place of the handler's to the request the handler gave back.
fn answered_to<B>(request: HttpRequest, answer: StoredResponse) -> ServiceResponse<EitherBody<B>> {
    ServiceResponse::new(request, into_http_response(answer)).map_into_right_body()
}
