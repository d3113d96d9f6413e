//! The middleware: [`Idempotency`], a `Transform`, and the hidden service it wraps
//! a resource or scope in.

use std::fmt;
use std::future::{Ready, ready};
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::Arc;

use actix_web::body::{BoxBody, EitherBody, MessageBody};
use actix_web::dev::{Payload, Service, ServiceRequest, ServiceResponse, Transform, forward_ready};
use actix_web::http::header::CONTENT_LENGTH;
use actix_web::{Error, HttpMessage, HttpRequest, HttpResponse};
use bytes::BytesMut;
use futures_util::future::{FutureExt, LocalBoxFuture};
use futures_util::stream::StreamExt;
use idem_core::{
    Admission, Begin, Engine, Execution, Fingerprint, KEY_HEADER, KeyRequirement, Policy, Problem,
    RequestHead, Scope, Store, StoredResponse,
};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::capture::{Captured, capture};
use crate::edge::{
    ProblemError, RequestHeaders, into_http_response, stored_headers, stored_status,
};
use crate::extract::IdempotencyInfo;

/// Makes a resource or scope safe to retry: wraps it so that requests with the same
/// `Idempotency-Key` run the handler once and replay its answer.
///
/// Built with consuming setters over a core [`Policy`]; nothing is looked up from
/// `app_data` at request time.
///
/// ```
/// use actix_web::{App, HttpResponse, web};
/// use idem_actix::Idempotency;
/// use idem_core::MemoryStore;
///
/// let store = MemoryStore::new();
/// let app = App::new().service(
///     web::resource("/charges")
///         .wrap(Idempotency::new(store.clone()).required())
///         .route(web::post().to(|| async { HttpResponse::Created().finish() })),
/// );
/// # drop(app);
/// ```
#[derive(Clone)]
#[must_use]
pub struct Idempotency {
    store: Arc<dyn Store>,
    policy: Policy,
    scope: ScopeSource,
}

/// Where the scope of a request comes from.
#[derive(Clone)]
enum ScopeSource {
    Global,
    Request(Arc<ScopeFn>),
}

/// The application's way to name a request's scope.
type ScopeFn = dyn Fn(&HttpRequest) -> Option<Scope> + Send + Sync;

impl Idempotency {
    /// Idempotency over `store` with [`Policy::required`]'s defaults, every
    /// request in [`Scope::global`].
    pub fn new(store: impl Store) -> Self {
        Self::from_shared(Arc::new(store))
    }

    /// Idempotency over a store already shared as `Arc<dyn Store>`.
    pub fn from_shared(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            policy: Policy::required(),
            scope: ScopeSource::Global,
        }
    }

    /// Replaces the whole policy (lease, retention, limits, statuses…).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Covered requests without a key are answered `400 missing-key`.
    pub fn required(mut self) -> Self {
        self.policy = self.policy.requirement(KeyRequirement::Required);
        self
    }

    /// Covered requests without a key pass through untouched.
    pub fn optional(mut self) -> Self {
        self.policy = self.policy.requirement(KeyRequirement::Optional);
        self
    }

    /// Takes each request's scope from `scope`, run on the request before its body
    /// is read. `None` answers `500 scope-unavailable` and the handler does not run.
    ///
    /// Scope by what the application has authenticated. Scoping by a header the
    /// client sets, unauthenticated, is unsafe: any client could send another's
    /// scope with a guessed key and be replayed that client's answer.
    pub fn scope_fn<F>(mut self, scope: F) -> Self
    where
        F: Fn(&HttpRequest) -> Option<Scope> + Send + Sync + 'static,
    {
        self.scope = ScopeSource::Request(Arc::new(scope));
        self
    }

    /// Takes each request's scope from a request extension of type `T`, inserted
    /// by the application's authentication middleware (which must run first, i.e.
    /// be registered on an enclosing `App` or scope). A request without it is
    /// answered `500 scope-unavailable`.
    pub fn scope_from_extension<T>(self) -> Self
    where
        T: Clone + Into<Scope> + 'static,
    {
        self.scope_fn(|request| request.extensions().get::<T>().cloned().map(Into::into))
    }

    /// The policy applied.
    pub fn get_policy(&self) -> &Policy {
        &self.policy
    }
}

impl fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("policy", &self.policy)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for ScopeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Global => f.write_str("Global"),
            Self::Request(_) => f.write_str("Request(..)"),
        }
    }
}

impl ScopeSource {
    fn resolve(&self, request: &HttpRequest) -> Option<Scope> {
        match self {
            Self::Global => Some(Scope::global()),
            Self::Request(scope) => scope(request),
        }
    }
}

impl<S, B> Transform<S, ServiceRequest> for Idempotency
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Transform = IdempotencyMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(IdempotencyMiddleware {
            service: Rc::new(service),
            engine: Engine::from_shared(Arc::clone(&self.store), self.policy.clone()),
            scope: self.scope.clone(),
        }))
    }
}

/// The service [`Idempotency`] wraps a resource in. Not used directly.
#[doc(hidden)]
pub struct IdempotencyMiddleware<S> {
    service: Rc<S>,
    engine: Engine,
    scope: ScopeSource,
}

impl<S, B> Service<ServiceRequest> for IdempotencyMiddleware<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B>>;
    type Error = Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Self::Error>>;

    forward_ready!(service);

    fn call(&self, request: ServiceRequest) -> Self::Future {
        let service = Rc::clone(&self.service);
        let engine = self.engine.clone();
        let scope = self.scope.clone();
        Box::pin(handle(service, engine, scope, request))
    }
}

type Answer<B> = Result<ServiceResponse<EitherBody<B>>, Error>;

/// Admits the request, then runs it keyed or passes it through.
async fn handle<S, B>(
    service: Rc<S>,
    engine: Engine,
    scope: ScopeSource,
    request: ServiceRequest,
) -> Answer<B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    let admission = engine.admit(
        request.method().as_str(),
        request
            .headers()
            .get_all(KEY_HEADER)
            .map(|value| value.as_bytes()),
    );
    let key = match admission {
        Admission::PassThrough => return pass_through(&service, request).await,
        Admission::Reject(problem) => return Ok(problem_answer(request, &problem)),
        Admission::Keyed(key) => key,
    };
    let Some(scope) = scope.resolve(request.request()) else {
        return Ok(problem_answer(request, &engine.scope_unavailable()));
    };
    let span = tracing::info_span!(
        target: "idem",
        "idempotent_request",
        key = %key.redacted(),
        scope = %scope,
        method = %request.method(),
        path = request.path(),
    );
    let info = IdempotencyInfo {
        key,
        scope,
        first_execution: true,
    };
    keyed(service, engine, info, request).instrument(span).await
}

/// Fingerprints the request, claims its record and does what the engine decides.
async fn keyed<S, B>(
    service: Rc<S>,
    engine: Engine,
    mut info: IdempotencyInfo,
    mut request: ServiceRequest,
) -> Answer<B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    let fingerprint = match read_body(&engine, &mut request).await {
        Ok(fingerprint) => fingerprint,
        Err(RequestBody::TooLarge) => {
            return Ok(problem_answer(request, &engine.payload_too_large()));
        }
        Err(RequestBody::Failed(error)) => return Err(error),
    };
    match engine
        .begin(info.scope.clone(), info.key.clone(), fingerprint)
        .await
    {
        Begin::Execute(execution) => {
            request.extensions_mut().insert(info);
            execute(service, engine, execution, request).await
        }
        Begin::Replay(stored) => Ok(stored_answer(request, stored)),
        Begin::Reject(problem) => Ok(problem_answer(request, &problem)),
        Begin::Unguarded => {
            // The store failed and the route fails open: nothing is known about
            // earlier executions.
            info.first_execution = false;
            request.extensions_mut().insert(info);
            pass_through(&service, request).await
        }
    }
}

/// Why the request body was not read.
enum RequestBody {
    /// Over the policy's limit.
    TooLarge,
    /// The payload failed (the client went away, a malformed chunked body).
    Failed(Error),
}

/// Reads the request body up to the limit, fingerprinting it as it streams, and
/// puts it back whole for the handler.
async fn read_body(
    engine: &Engine,
    request: &mut ServiceRequest,
) -> Result<Fingerprint, RequestBody> {
    let limit = engine.policy().request_body_limit_bytes();
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(RequestBody::TooLarge);
    }
    let mut fingerprint = {
        let headers = RequestHeaders(request.headers());
        engine.fingerprint(&RequestHead {
            method: request.method().as_str(),
            path: request.path(),
            query: request.query_string(),
            headers: &headers,
        })
    };
    let mut payload = request.take_payload();
    let mut body = BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|error| RequestBody::Failed(error.into()))?;
        if body.len() + chunk.len() > limit {
            return Err(RequestBody::TooLarge);
        }
        fingerprint.update(&chunk);
        body.extend_from_slice(&chunk);
    }
    request.set_payload(Payload::from(body.freeze()));
    Ok(fingerprint.finish())
}

/// Runs the handler on this worker, to completion even if the client goes away,
/// and records its answer.
async fn execute<S, B>(
    service: Rc<S>,
    engine: Engine,
    execution: Execution,
    request: ServiceRequest,
) -> Answer<B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    let (sender, receiver) = oneshot::channel();
    // Spawned, not awaited here: actix drops this future when the client
    // disconnects, and the handler must not be cancelled with it.
    actix_web::rt::spawn(
        async move {
            let answer = run_and_record(service, execution, request).await;
            // Nobody is waiting when the client went away; the answer is recorded.
            let _ = sender.send(answer);
        }
        .in_current_span(),
    );
    match receiver.await {
        Ok(answer) => answer,
        // The worker is shutting down and dropped the task; the execution's drop
        // released the claim.
        Err(_) => Err(ProblemError(engine.handler_failed()).into()),
    }
}

/// What the handler did, as seen from inside `Execution::run`.
enum Ran<B> {
    Responded {
        request: HttpRequest,
        head: HttpResponse<()>,
        body: Captured<B>,
    },
    ServiceFailed(Error),
    BodyFailed {
        request: HttpRequest,
        error: crate::capture::BodyError,
    },
}

async fn run_and_record<S, B>(
    service: Rc<S>,
    execution: Execution,
    request: ServiceRequest,
) -> Answer<B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    // No clone of the request is kept while the service runs: actix's router needs
    // it unshared.
    let limit = execution.stored_body_limit();
    let handler = async move {
        let response = match service.call(request).await {
            Ok(response) => response,
            Err(error) => return Ran::ServiceFailed(error),
        };
        let (request, response) = response.into_parts();
        let (head, body) = response.into_parts();
        match capture(body, limit).await {
            Ok(body) => Ran::Responded {
                request,
                head,
                body,
            },
            Err(error) => Ran::BodyFailed { request, error },
        }
    };
    let ran = execution
        .run(AssertUnwindSafe(handler).catch_unwind())
        .await;
    let (request, head, body) = match ran {
        Ok(Ran::Responded {
            request,
            head,
            body,
        }) => (request, head, body),
        Ok(Ran::ServiceFailed(error)) => {
            // The application's own error answer, not recorded: a retry runs again.
            tracing::warn!(target: "idem", error = %error, "the service returned an error");
            execution.fail().await;
            return Err(error);
        }
        Ok(Ran::BodyFailed { request, error }) => {
            tracing::error!(target: "idem", error = %error, "the response body failed while it was read");
            let problem = execution.fail().await;
            return Ok(problem_response(request, &problem));
        }
        Err(_panic) => {
            tracing::error!(target: "idem", "the handler panicked");
            // The request went down with the handler: the problem travels as an
            // error, which actix answers with its response.
            return Err(ProblemError(execution.fail().await).into());
        }
    };
    let status = stored_status(head.status());
    let headers = stored_headers(head.headers());
    // A failure to record is logged by the engine; the client gets the answer anyway.
    let response = match body {
        Captured::Whole(bytes) => {
            let stored = StoredResponse::new(status, headers, bytes.clone());
            let _ = execution.finish(&stored).await;
            head.set_body(BoxBody::new(bytes)).map_into_right_body()
        }
        Captured::Unread(body) => {
            let _ = execution
                .finish(&StoredResponse::without_body(status, headers))
                .await;
            head.set_body(body).map_into_left_body()
        }
        Captured::Overflow(body) => {
            let _ = execution
                .finish(&StoredResponse::without_body(status, headers))
                .await;
            head.set_body(BoxBody::new(body)).map_into_right_body()
        }
    };
    Ok(ServiceResponse::new(request, response))
}

async fn pass_through<S, B>(service: &S, request: ServiceRequest) -> Answer<B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error>,
{
    service
        .call(request)
        .await
        .map(ServiceResponse::map_into_left_body)
}

fn problem_answer<B>(request: ServiceRequest, problem: &Problem) -> ServiceResponse<EitherBody<B>> {
    stored_answer(request, problem.to_response())
}

fn stored_answer<B>(
    request: ServiceRequest,
    stored: StoredResponse,
) -> ServiceResponse<EitherBody<B>> {
    request
        .into_response(into_http_response(stored))
        .map_into_right_body()
}

fn problem_response<B>(request: HttpRequest, problem: &Problem) -> ServiceResponse<EitherBody<B>> {
    ServiceResponse::new(request, into_http_response(problem.to_response())).map_into_right_body()
}
