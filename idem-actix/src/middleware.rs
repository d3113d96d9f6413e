//! The middleware: [`Idempotency`], a `Transform`, and the hidden service it wraps
//! a resource or scope in.

use std::fmt;
use std::future::{Ready, ready};
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use actix_web::body::{BoxBody, EitherBody, MessageBody};
use actix_web::dev::{Payload, Service, ServiceRequest, ServiceResponse, Transform, forward_ready};
use actix_web::http::header::CONTENT_LENGTH;
use actix_web::{Error, HttpMessage, HttpRequest, HttpResponse};
use bytes::BytesMut;
use futures_util::future::{FutureExt, LocalBoxFuture};
use futures_util::stream::StreamExt;
use idem_core::{
    Admission, Begin, Engine, Execution, Fingerprint, FingerprintSpec, InProgress, KEY_HEADER,
    KeyRequirement, OnStoreFailure, Policy, Problem, RequestHead, Scope, Settlement, StatusFilter,
    Store, StoredResponse,
};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::capture::{Captured, capture};
use crate::edge::{
    ProblemError, RequestHeaders, into_http_response, stored_headers, stored_status,
};
use crate::extract::ExecutionInfo;

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
    /// Idempotency over `store`: keys required, POST and PATCH covered, every
    /// limit and duration the contract's default, every request in
    /// [`Scope::global`].
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
    /// # use idem_actix::Idempotency;
    /// # use idem_core::{MemoryStore, StatusFilter};
    /// let idempotency = Idempotency::new(MemoryStore::new())
    ///     .configure(|policy| policy.stored_statuses(StatusFilter::new(|status| status < 300)));
    /// assert!(!idempotency.current_policy().stores(404));
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

    /// Makes a request whose key is in progress wait up to `up_to` and replay the
    /// first request's answer (past the bound, `409`).
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
    /// in its extensions. That middleware must run first: register it on the
    /// enclosing `App` or `web::scope`, or `wrap` it after this one on the same
    /// resource. A request without a `T` is answered `500 scope-unavailable`: the
    /// route is misconfigured, and answering in some other scope could show one
    /// client another's answer.
    pub fn scope_from_extension<T>(self) -> Self
    where
        T: Clone + Into<Scope> + 'static,
    {
        self.scope_with(|request| request.extensions().get::<T>().cloned().map(Into::into))
    }

    /// Scopes each request by what `scope` finds in it, before its body is read.
    /// `None` is answered `500 scope-unavailable` and the handler does not run.
    ///
    /// Never return a raw header the client controls (an `X-Tenant-Id`): any
    /// client could then send another's value with a guessed key and read their
    /// answer. Return what authentication established.
    pub fn scope_with<F>(mut self, scope: F) -> Self
    where
        F: Fn(&HttpRequest) -> Option<Scope> + Send + Sync + 'static,
    {
        self.scope = ScopeSource::Request(Arc::new(scope));
        self
    }

    /// The policy the middleware applies.
    pub fn current_policy(&self) -> &Policy {
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
    let info = ExecutionInfo::new(key, scope, true);
    keyed(service, engine, info, request).instrument(span).await
}

/// Fingerprints the request, claims its record and does what the engine decides.
async fn keyed<S, B>(
    service: Rc<S>,
    engine: Engine,
    info: ExecutionInfo,
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
        .begin(info.scope().clone(), info.key().clone(), fingerprint)
        .await
    {
        Begin::Execute(execution) => {
            let context = execution.context().cloned();
            request.extensions_mut().insert(info.with_context(context));
            execute(service, engine, execution, request).await
        }
        Begin::Replay(stored) => Ok(stored_answer(request, stored)),
        Begin::Reject(problem) => Ok(problem_answer(request, &problem)),
        Begin::Unguarded => {
            // The store failed and the route fails open: the handler runs
            // unguarded.
            request.extensions_mut().insert(info.unguarded());
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
    // The handler's answer, unless a transactional store lost the commit (and
    // the handler's writes with it): then a 503. Other failures to record are
    // logged by the engine; the client gets the answer anyway.
    let stored = match &body {
        Captured::Whole(bytes) => StoredResponse::new(status, headers, bytes.clone()),
        Captured::Unread(_) | Captured::Overflow(_) => {
            StoredResponse::without_body(status, headers)
        }
    };
    if let Settlement::Retract(problem) = execution.settle(&stored).await {
        return Ok(problem_response(request, &problem));
    }
    let response = match body {
        Captured::Whole(bytes) => head.set_body(BoxBody::new(bytes)).map_into_right_body(),
        Captured::Unread(body) => head.set_body(body).map_into_left_body(),
        Captured::Overflow(body) => head.set_body(BoxBody::new(body)).map_into_right_body(),
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
