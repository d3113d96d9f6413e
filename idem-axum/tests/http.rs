//! idem-axum over real HTTP: the shared scenario suite against the axum build of
//! the scenario app, over every store (in memory, SQLite, PostgreSQL, Redis and
//! Redis Cluster), then what is particular to this adapter (extractors, scope
//! sources, plain Tower services).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
use idem_axum::{ExecutionInfo, IdempotencyLayer, Key, RequestBody};
use idem_core::store::{Claim, ClaimOutcome, ClaimRequest, Record, StoreFuture};
use idem_core::{IdempotencyKey, MemoryStore, OnStoreFailure, Scope, Store, StoredResponse};
use idem_diesel::testing::{DEFAULT_DATABASE, TestCluster};
use idem_diesel::{PgStore, SqliteStore};
use idem_redis::testing::TestRedis;
use idem_scenarios::{FailingStore, ScenarioAnswer, ScenarioApp, ScenarioRequest, Target};
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
    let principal = Principal(idem_scenarios::principal(authorization));
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
    for route in idem_scenarios::routes() {
        let idempotency = IdempotencyLayer::from_shared(Arc::clone(store))
            .policy(route.policy)
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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
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

    idem_scenarios::scenario_tests!(start);
}

/// The suite over a fresh SQLite file per case.
mod sqlite {
    use super::{sqlite_store, start};

    idem_scenarios::scenario_tests!(start, store = sqlite_store);
}

/// The suite over a fresh PostgreSQL cluster per case.
mod postgres {
    use super::{postgres_store, start};

    idem_scenarios::scenario_tests!(start, store = postgres_store);
}

/// The suite over one Redis node and over a Redis Cluster (one of each for the
/// whole binary, a fresh key prefix per case).
mod redis {
    use super::start;

    idem_scenarios::scenario_tests!(start, store = crate::redis_store);

    mod cluster {
        use super::super::start;

        idem_scenarios::scenario_tests!(start, store = crate::redis_cluster_store);
    }
}

async fn redis_store() -> Arc<dyn Store> {
    Arc::new(TestRedis::shared().fresh_store().await)
}

async fn redis_cluster_store() -> Arc<dyn Store> {
    Arc::new(TestRedis::shared_cluster().fresh_store().await)
}

/// A store, and what must live exactly as long as it: its temporary directory,
/// its database server. Dropped with the app's last handle to the store.
struct Owning<S, G> {
    store: S,
    _owned: G,
}

impl<S: Store, G: Send + Sync + 'static> Store for Owning<S, G> {
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        self.store.claim(request)
    }
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        self.store.renew(claim, lease)
    }
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        self.store.complete(claim, response, retention)
    }
    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        self.store.release(claim)
    }
    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        self.store.load(scope, key)
    }
    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        self.store.delete_expired(batch)
    }
    fn changed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        poll: Duration,
    ) -> StoreFuture<'a, ()> {
        self.store.changed(scope, key, poll)
    }
}

/// A temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn sqlite_store() -> Arc<dyn Store> {
    let dir = TempDir(std::env::temp_dir().join(format!("idem-axum-{}", uuid::Uuid::new_v4())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let path = dir.0.join("idem.db");
    let store = SqliteStore::connect(path.to_str().unwrap()).await.unwrap();
    store.migrate().await.unwrap();
    Arc::new(Owning { store, _owned: dir })
}

async fn postgres_store() -> Arc<dyn Store> {
    let cluster = tokio::task::spawn_blocking(TestCluster::start)
        .await
        .unwrap()
        .unwrap_or_else(|error| panic!("cannot start a PostgreSQL cluster: {error}"));
    let store = PgStore::connect(&cluster.url(DEFAULT_DATABASE))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    Arc::new(Owning {
        store,
        _owned: cluster,
    })
}

/// Durable stores beyond the suite: instances of the app sharing one database,
/// and the database going away under a running app.
///
/// Here rather than in idem-diesel's `stores` binary: the cases need an app,
/// and the axum build of the scenario app is this file's. Each test starts a
/// cluster of its own, since the outage stops it and the suite's PostgreSQL
/// tests each have theirs too.
mod durable {
    use std::sync::Arc;

    use idem_diesel::testing::{ClusterError, DEFAULT_DATABASE, TestCluster};
    use idem_diesel::{PgStore, SqliteStore};
    use idem_redis::testing::{TestRedis, TestRedisError};
    use idem_scenarios::durable::{
        ServerFuture, StoreServer, one_key_over_instances_executes_once,
        store_outage_fails_closed_then_recovers,
    };

    use super::{TempDir, start};

    /// Two instances, each with its own `PgStore` (its own pool), over one
    /// database: 200 concurrent requests with one key, spread over both.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_instances_share_one_postgres_database() {
        let cluster = start_cluster().await;
        let url = cluster.url(DEFAULT_DATABASE);
        let mut instances = Vec::new();
        for _ in 0..2 {
            let store = PgStore::connect(&url).await.unwrap();
            store.migrate().await.unwrap();
            instances.push(start(Arc::new(store)).await);
        }
        one_key_over_instances_executes_once(instances).await;
        stop_cluster(cluster).await;
    }

    /// Two instances on one machine, each with its own `SqliteStore` (its own
    /// pool) over one file.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_instances_share_one_sqlite_file() {
        let dir = TempDir(std::env::temp_dir().join(format!("idem-axum-{}", uuid::Uuid::new_v4())));
        std::fs::create_dir_all(&dir.0).unwrap();
        let path = dir.0.join("idem.db");
        let mut instances = Vec::new();
        for _ in 0..2 {
            let store = SqliteStore::connect(path.to_str().unwrap()).await.unwrap();
            store.migrate().await.unwrap();
            instances.push(start(Arc::new(store)).await);
        }
        one_key_over_instances_executes_once(instances).await;
    }

    /// PostgreSQL stops under the running app, then starts again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_outage_fails_closed_then_recovers() {
        let cluster = Arc::new(start_cluster().await);
        let store = PgStore::connect(&cluster.url(DEFAULT_DATABASE))
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let target = start(Arc::new(store)).await;
        store_outage_fails_closed_then_recovers(target, &Stoppable(Arc::clone(&cluster))).await;
        stop_cluster(Arc::into_inner(cluster).unwrap()).await;
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
        let target = start(Arc::new(redis.fresh_store().await)).await;
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

    async fn redis_step(step: impl FnOnce() -> Result<(), TestRedisError> + Send + 'static) {
        tokio::task::spawn_blocking(step)
            .await
            .unwrap()
            .unwrap_or_else(|error| panic!("the test Redis failed: {error}"));
    }

    /// A test cluster as the outage case stops and resumes it.
    struct Stoppable(Arc<TestCluster>);

    impl StoreServer for Stoppable {
        fn stop(&self) -> ServerFuture<'_> {
            let cluster = Arc::clone(&self.0);
            Box::pin(blocking(move || cluster.stop()))
        }

        fn resume(&self) -> ServerFuture<'_> {
            let cluster = Arc::clone(&self.0);
            Box::pin(blocking(move || cluster.resume()))
        }
    }

    /// Runs a step of the cluster on a blocking thread; panics with its error.
    async fn blocking(step: impl FnOnce() -> Result<(), ClusterError> + Send + 'static) {
        tokio::task::spawn_blocking(step)
            .await
            .unwrap()
            .unwrap_or_else(|error| panic!("the test cluster failed: {error}"));
    }

    async fn start_cluster() -> TestCluster {
        tokio::task::spawn_blocking(TestCluster::start)
            .await
            .unwrap()
            .unwrap_or_else(|error| panic!("cannot start a PostgreSQL cluster: {error}"))
    }

    /// Stops and deletes the cluster here, before the test ends (the apps may
    /// still hold pools to it; they go with the runtime).
    async fn stop_cluster(cluster: TestCluster) {
        tokio::task::spawn_blocking(move || drop(cluster))
            .await
            .unwrap();
    }
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

async fn describe(execution: ExecutionInfo, key: Option<Key>) -> String {
    format!(
        "{} {} {} {}",
        execution.key().as_str(),
        execution.scope(),
        execution.is_guarded(),
        key.map(|Key(key)| key.as_str().to_owned())
            .unwrap_or_default()
    )
}

async fn describe_optional(execution: Option<ExecutionInfo>, key: Option<Key>) -> String {
    format!("{} {}", execution.is_some(), key.is_some())
}

#[tokio::test]
async fn extractors_see_the_key_the_scope_and_the_claim() {
    let store = MemoryStore::new();
    let app = Router::new()
        .route(
            "/described",
            post(describe).route_layer(
                IdempotencyLayer::new(store.clone()).scope_with(|_| Some(Scope::new("tenant-7"))),
            ),
        )
        .route(
            "/optional",
            post(describe_optional).route_layer(IdempotencyLayer::new(store).optional()),
        );
    let response = app
        .clone()
        .oneshot(post_with_key("/described", Some("\"k-1\""), "{}"))
        .await
        .unwrap();
    assert_eq!(
        read(response).await,
        (StatusCode::OK, Bytes::from("k-1 tenant-7 true k-1"))
    );
    let unkeyed = app
        .clone()
        .oneshot(post_with_key("/optional", None, "{}"))
        .await
        .unwrap();
    assert_eq!(read(unkeyed).await.1, "false false");
    let keyed = app
        .oneshot(post_with_key("/optional", Some("k-2"), "{}"))
        .await
        .unwrap();
    assert_eq!(read(keyed).await.1, "true true");
}

#[tokio::test]
async fn a_handler_without_the_layer_cannot_extract_a_key() {
    let app = Router::new().route("/bare", post(describe));
    let response = app
        .oneshot(post_with_key("/bare", Some("k-1"), "{}"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
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
            IdempotencyLayer::new(MemoryStore::new()).scope_from_extension::<Principal>(),
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
            IdempotencyLayer::new(FailingStore).on_store_failure(OnStoreFailure::FailOpen),
        ),
    );
    let response = app
        .oneshot(post_with_key("/described", Some("k-1"), "{}"))
        .await
        .unwrap();
    assert_eq!(read(response).await.1, "k-1  false k-1");
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
        .layer(IdempotencyLayer::new(MemoryStore::new()))
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
        .layer(IdempotencyLayer::new(MemoryStore::new()))
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
            IdempotencyLayer::new(MemoryStore::new())
                .request_body_limit(4)
                .configure(|policy| {
                    policy.problem_statuses(idem_core::ProblemStatuses {
                        payload_too_large: 400,
                        ..Default::default()
                    })
                }),
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
        any(counted).layer(IdempotencyLayer::new(MemoryStore::new()).methods(["PUT"])),
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
