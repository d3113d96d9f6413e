//! idem-axum over real HTTP: the shared scenario suite against the axum build of
//! the scenario app, over every store (in memory, SQLite, PostgreSQL), then what
//! is particular to this adapter (extractors, scope sources, plain Tower
//! services).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use idem_axum::{ContextRouteError, ExecutionInfo, IdempotencyLayer, RequestBody, StoreContext};
use idem_core::{Engine, MemoryStore, OnStoreFailure, Policy, Scope, Store};
use idem_http_suite::{
    FailingStore, HandsATill, PromisesATill, ScenarioAnswer, ScenarioApp, ScenarioRequest, Target,
    Till, assert_route_misconfigured,
};
use tower::{ServiceBuilder, ServiceExt};

// ---------------------------------------------------------------------------
// The scenario app on axum.

/// The authenticated principal (the scenario app trusts the bearer token).
#[derive(Clone, Debug)]
struct Principal(Scope);

impl From<Principal> for Scope {
    fn from(principal: Principal) -> Self {
        principal.0
    }
}

async fn authenticate(mut request: Request, next: Next) -> Response {
    let authorization = request
        .headers()
        .get(AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    let principal = Principal(idem_http_suite::principal(authorization));
    request.extensions_mut().insert(principal);
    next.run(request).await
}

async fn guarded(
    State(app): State<ScenarioApp>,
    Extension(Principal(scope)): Extension<Principal>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let request = ScenarioRequest {
        method: method.to_string(),
        path: uri.path().to_owned(),
        query: uri.query().unwrap_or("").to_owned(),
        principal: scope.to_string(),
        body,
    };
    send(app.handle(request).await)
}

async fn executions(State(app): State<ScenarioApp>) -> Response {
    send(app.executions())
}

async fn open_gate(State(app): State<ScenarioApp>, Path(name): Path<String>) -> Response {
    send(app.open_gate(&name))
}

/// The answer with its body streamed chunk by chunk.
fn send(answer: ScenarioAnswer) -> Response {
    let mut response = Response::builder().status(answer.status);
    for (name, value) in answer.headers {
        response = response.header(name, value);
    }
    let chunks = answer.body.into_iter().map(Ok::<_, Infallible>);
    response
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap()
}

fn scenario_router(store: &Arc<dyn Store>) -> Router {
    let mut router = Router::new()
        .route("/executions", get(executions))
        .route("/gates/{name}", post(open_gate));
    for route in idem_http_suite::routes() {
        let idempotency =
            IdempotencyLayer::from_engine(Engine::from_shared(Arc::clone(store), route.policy))
                .scope_from_extension::<Principal>();
        // `any` routes have no method routes for `route_layer` to wrap.
        router = router.route(route.path, any(guarded).layer(idempotency));
    }
    router
        .layer(middleware::from_fn(authenticate))
        .with_state(ScenarioApp::new())
}

/// Stops the server when the target is dropped.
struct Serving(tokio::task::JoinHandle<()>);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn start(store: Arc<dyn Store>) -> Target {
    let listener = idem_http_suite::bind().unwrap();
    let addr = listener.local_addr().unwrap();
    let router = scenario_router(&store);
    let server = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    Target::new(addr, Serving(server))
}

/// The suite over the in-memory store.
mod scenarios {
    use super::start;

    idem_http_suite::scenario_tests!(start);
}

/// The suite over a fresh SQLite file per case.
mod sqlite {
    use super::start;

    idem_http_suite::scenario_tests!(start, store = idem_http_suite::stores::sqlite_store);
}

/// The suite over a fresh PostgreSQL database per case.
mod postgres {
    use super::start;

    idem_http_suite::scenario_tests!(start, store = idem_http_suite::stores::postgres_store);
}

/// Durable stores beyond the suite: instances of the app sharing one database,
/// and the database going away under a running app.
mod durable {
    use super::start;

    idem_http_suite::durable_tests!(start);
}

// ---------------------------------------------------------------------------
// What is particular to idem-axum.

fn post_with_key(uri: &str, key: Option<&str>, body: &'static str) -> Request {
    let mut request = Request::post(uri);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(Body::from(body)).unwrap()
}

async fn read(response: Response) -> (StatusCode, Bytes) {
    let status = response.status();
    (
        status,
        response.into_body().collect().await.unwrap().to_bytes(),
    )
}

fn problem_type(body: &[u8]) -> String {
    let json: serde_json::Value = serde_json::from_slice(body).unwrap();
    json["type"].as_str().unwrap().to_owned()
}

async fn describe(execution: ExecutionInfo) -> String {
    format!(
        "{} {} {} {}",
        execution.key().as_str(),
        execution.scope(),
        execution.is_guarded(),
        execution.lease_lost(),
    )
}

async fn describe_optional(execution: Option<ExecutionInfo>) -> String {
    format!("{}", execution.is_some())
}

#[tokio::test]
async fn extractors_see_the_key_the_scope_and_the_claim() {
    let store = MemoryStore::new();
    let app = Router::new()
        .route(
            "/described",
            post(describe).route_layer(
                IdempotencyLayer::new(store.clone(), Policy::required())
                    .scope_with(|_| Some(Scope::new("tenant-7"))),
            ),
        )
        .route(
            "/optional",
            post(describe_optional)
                .route_layer(IdempotencyLayer::new(store, Policy::optional()).global_scope()),
        );
    let response = app
        .clone()
        .oneshot(post_with_key("/described", Some("\"k-1\""), "{}"))
        .await
        .unwrap();
    assert_eq!(
        read(response).await,
        (StatusCode::OK, Bytes::from("k-1 tenant-7 true false"))
    );
    let unkeyed = app
        .clone()
        .oneshot(post_with_key("/optional", None, "{}"))
        .await
        .unwrap();
    assert_eq!(read(unkeyed).await.1, "false");
    let keyed = app
        .oneshot(post_with_key("/optional", Some("k-2"), "{}"))
        .await
        .unwrap();
    assert_eq!(read(keyed).await.1, "true");
}

#[tokio::test]
async fn a_handler_without_the_layer_cannot_extract_a_key() {
    let app = Router::new().route("/bare", post(describe));
    let response = app
        .oneshot(post_with_key("/bare", Some("k-1"), "{}"))
        .await
        .unwrap();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|value| value.to_str().unwrap().to_owned());
    let (status, body) = read(response).await;
    assert_route_misconfigured(status.as_u16(), content_type.as_deref(), &body);
}

#[tokio::test]
async fn a_request_without_a_scope_is_refused_and_not_run() {
    let runs = Arc::new(AtomicU64::new(0));
    let counted = {
        let runs = Arc::clone(&runs);
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            "ran"
        }
    };
    let app = Router::new().route(
        "/charges",
        post(counted).route_layer(
            IdempotencyLayer::new(MemoryStore::new(), Policy::required())
                .scope_from_extension::<Principal>(),
        ),
    );
    let response = app
        .oneshot(post_with_key("/charges", Some("k-1"), "{}"))
        .await
        .unwrap();
    let (status, body) = read(response).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        problem_type(&body),
        "https://idem.rs/problems/scope-unavailable"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_fail_open_route_tells_the_handler_it_is_unguarded() {
    let app = Router::new().route(
        "/described",
        post(describe).route_layer(
            IdempotencyLayer::new(
                FailingStore,
                Policy::required().on_store_failure(OnStoreFailure::FailOpen),
            )
            .global_scope(),
        ),
    );
    let response = app
        .oneshot(post_with_key("/described", Some("k-1"), "{}"))
        .await
        .unwrap();
    assert_eq!(read(response).await.1, "k-1  false false");
}

/// A plain Tower service (no axum) that counts its calls and echoes the body.
fn counting_service(
    runs: Arc<AtomicU64>,
) -> impl tower::Service<
    http::Request<RequestBody<Full<Bytes>>>,
    Response = http::Response<Full<Bytes>>,
    Error = &'static str,
    Future = impl Send,
> + Clone {
    tower::service_fn(move |request: http::Request<RequestBody<Full<Bytes>>>| {
        let runs = Arc::clone(&runs);
        async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let fail = request.uri().path() == "/fail" && run == 1;
            let body = request.into_body().collect().await.unwrap().to_bytes();
            if fail {
                return Err("the service failed");
            }
            Ok(http::Response::builder()
                .status(201)
                .header("x-run", run)
                .body(Full::new(Bytes::from(format!(
                    "run {run}: {}",
                    String::from_utf8_lossy(&body)
                ))))
                .unwrap())
        }
    })
}

fn plain_request(path: &str, body: &'static str) -> http::Request<Full<Bytes>> {
    http::Request::post(path)
        .header("idempotency-key", "plain-1")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

#[tokio::test]
async fn it_guards_a_plain_tower_service_in_a_service_builder() {
    let runs = Arc::new(AtomicU64::new(0));
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new(), Policy::required()).global_scope())
        .service(counting_service(Arc::clone(&runs)));
    let first = service
        .clone()
        .oneshot(plain_request("/echo", "hello"))
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    assert_eq!(
        first.into_body().collect().await.unwrap().to_bytes(),
        "run 1: hello"
    );
    let replay = service
        .oneshot(plain_request("/echo", "hello"))
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["x-run"], "1");
    assert_eq!(
        replay.into_body().collect().await.unwrap().to_bytes(),
        "run 1: hello"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_service_error_is_returned_and_releases_the_claim() {
    let runs = Arc::new(AtomicU64::new(0));
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new(), Policy::required()).global_scope())
        .service(counting_service(Arc::clone(&runs)));
    let failed = service.clone().oneshot(plain_request("/fail", "x")).await;
    assert_eq!(failed.err(), Some("the service failed"));
    let retry = service.oneshot(plain_request("/fail", "x")).await.unwrap();
    assert_eq!(retry.status(), 201);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn problems_use_the_configured_statuses_and_limits() {
    let app = Router::new().route(
        "/small",
        post(|| async { "ran" }).route_layer(
            IdempotencyLayer::new(
                MemoryStore::new(),
                Policy::required().request_body_limit(4).problem_statuses(
                    idem_core::ProblemStatuses::default()
                        .status(idem_core::ProblemKind::PayloadTooLarge, 400),
                ),
            )
            .global_scope(),
        ),
    );
    let response = app
        .oneshot(post_with_key("/small", Some("k-1"), "12345"))
        .await
        .unwrap();
    let (status, body) = read(response).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        problem_type(&body),
        "https://idem.rs/problems/payload-too-large"
    );
}

#[tokio::test]
async fn uncovered_methods_can_be_configured() {
    let runs = Arc::new(AtomicU64::new(0));
    let counted = {
        let runs = Arc::clone(&runs);
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst)
                .to_string()
                .into_response()
        }
    };
    let app = Router::new().route(
        "/items",
        any(counted).layer(
            IdempotencyLayer::new(MemoryStore::new(), Policy::required().methods(["PUT"]))
                .global_scope(),
        ),
    );
    for method in [Method::PUT, Method::PUT, Method::POST, Method::POST] {
        let request = Request::builder()
            .method(method)
            .uri("/items")
            .header("idempotency-key", "k-1")
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(request).await.unwrap();
    }
    // One PUT ran (the second replayed), both POSTs passed through.
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// The suite over one Redis node and over a Redis Cluster (one of each for the
/// whole binary, a fresh key prefix per case).
mod redis {
    use std::sync::Arc;

    use idem_core::Store;
    use idem_http_suite::durable::{
        ServerFuture, StoreServer, store_outage_fails_closed_then_recovers,
    };

    use idem_testkit::TestRedis;

    use super::start;

    idem_http_suite::scenario_tests!(start, store = redis_store);

    mod cluster {
        use super::super::start;

        idem_http_suite::scenario_tests!(start, store = super::redis_cluster_store);
    }

    async fn redis_store() -> Arc<dyn Store> {
        Arc::new(idem_http_suite::stores::redis_store(TestRedis::shared()).await)
    }

    async fn redis_cluster_store() -> Arc<dyn Store> {
        Arc::new(idem_http_suite::stores::redis_store(TestRedis::shared_cluster()).await)
    }

    /// Redis stops under the running app, then starts again on its port.
    /// (idem-actix's tests/http.rs has an actix and an axum instance sharing a
    /// Redis Cluster.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_outage_fails_closed_then_recovers() {
        let redis = Arc::new(
            tokio::task::spawn_blocking(TestRedis::start)
                .await
                .unwrap()
                .unwrap_or_else(|error| panic!("cannot start redis-server: {error}")),
        );
        let target = start(Arc::new(idem_http_suite::stores::redis_store(&redis).await)).await;
        store_outage_fails_closed_then_recovers(target, &StoppableRedis(Arc::clone(&redis))).await;
    }

    /// A test Redis as the outage case stops and resumes it.
    struct StoppableRedis(Arc<TestRedis>);

    impl StoreServer for StoppableRedis {
        fn stop(&self) -> ServerFuture<'_> {
            let redis = Arc::clone(&self.0);
            Box::pin(redis_step(move || redis.stop()))
        }

        fn resume(&self) -> ServerFuture<'_> {
            let redis = Arc::clone(&self.0);
            Box::pin(redis_step(move || redis.resume()))
        }
    }

    async fn redis_step(step: impl FnOnce() -> Result<(), idem_testkit::Error> + Send + 'static) {
        tokio::task::spawn_blocking(step)
            .await
            .unwrap()
            .unwrap_or_else(|error| panic!("the test Redis failed: {error}"));
    }
}

async fn with_till(till: StoreContext<Till>, Path(order): Path<String>, body: String) -> String {
    format!("{} for {order}: {body}", till.name)
}

async fn maybe_till(execution: Option<ExecutionInfo>) -> String {
    let till = execution.and_then(|execution| execution.context::<Till>());
    format!("{}", till.is_some())
}

#[tokio::test]
async fn a_handler_takes_what_its_store_hands_it_typed_or_is_refused() {
    let handed = IdempotencyLayer::new(HandsATill(MemoryStore::new()), Policy::required())
        .global_scope()
        .on(Method::POST, with_till)
        .unwrap()
        .get(|| async { "not keyed" });
    let promised = IdempotencyLayer::new(PromisesATill(MemoryStore::new()), Policy::required())
        .global_scope()
        .on(Method::POST, with_till)
        .unwrap();
    let app = Router::new()
        .route("/handed/{order}", handed)
        .route("/promised/{order}", promised)
        .route(
            "/maybe",
            post(maybe_till).route_layer(
                IdempotencyLayer::new(MemoryStore::new(), Policy::required()).global_scope(),
            ),
        );
    let answer = app
        .clone()
        .oneshot(post_with_key("/handed/o-1", Some("k-1"), "{}"))
        .await
        .unwrap();
    assert_eq!(
        read(answer).await,
        (
            StatusCode::OK,
            Bytes::from("the request's till for o-1: {}")
        )
    );
    // The route's other methods, chained on what `on` built, are its own.
    let get = Request::get("/handed/o-1").body(Body::empty()).unwrap();
    let answer = app.clone().oneshot(get).await.unwrap();
    assert_eq!(
        read(answer).await,
        (StatusCode::OK, Bytes::from("not keyed"))
    );
    // A store that declares a till and hands none: the handler never runs.
    let refused = app
        .clone()
        .oneshot(post_with_key("/promised/o-1", Some("k-1"), "{}"))
        .await
        .unwrap();
    let content_type = refused
        .headers()
        .get("content-type")
        .map(|value| value.to_str().unwrap().to_owned());
    let (status, body) = read(refused).await;
    assert_route_misconfigured(status.as_u16(), content_type.as_deref(), &body);
    let maybe = app
        .oneshot(post_with_key("/maybe", Some("k-1"), "{}"))
        .await
        .unwrap();
    assert_eq!(read(maybe).await, (StatusCode::OK, Bytes::from("false")));
}

/// `on` refuses, as the route is built, a route that would hand the handler
/// no till: the engine's check, answered as it is.
#[test]
fn a_route_that_cannot_hand_what_its_handler_takes_is_refused_when_built() {
    let expected = std::any::type_name::<Till>();
    assert_eq!(
        IdempotencyLayer::new(MemoryStore::new(), Policy::required())
            .global_scope()
            .on(Method::POST, with_till)
            .map(|_: axum::routing::MethodRouter| ())
            .unwrap_err(),
        ContextRouteError::NotHanded {
            expected,
            handed: None
        }
    );
    let tilled =
        IdempotencyLayer::new(HandsATill(MemoryStore::new()), Policy::required()).global_scope();
    assert_eq!(
        tilled
            .on(Method::GET, with_till)
            .map(|_: axum::routing::MethodRouter| ())
            .unwrap_err(),
        ContextRouteError::MethodNotCovered {
            expected,
            method: "GET".into()
        }
    );
    let custom = Method::from_bytes(b"CHARGE").unwrap();
    let tilled = IdempotencyLayer::new(
        HandsATill(MemoryStore::new()),
        Policy::required().methods(["CHARGE"]),
    )
    .global_scope();
    assert_eq!(
        tilled
            .on(custom, with_till)
            .map(|_: axum::routing::MethodRouter| ())
            .unwrap_err(),
        ContextRouteError::UnroutableMethod {
            method: "CHARGE".into()
        }
    );
}
