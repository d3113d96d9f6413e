//! idem-actix over real HTTP on 127.0.0.1: actix's own server, a real client.
//! The shared scenario suite over every store (in memory, SQLite, PostgreSQL),
//! an actix and an axum instance sharing one PostgreSQL database, a PostgreSQL
//! outage under the app, then what is particular to actix.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix_web::dev::ServerHandle;
use actix_web::http::{Method, StatusCode};
use actix_web::{App, HttpMessage, HttpRequest, HttpResponse, HttpServer, web};
use idem_actix::{ContextRouteError, ExecutionInfo, Idempotency, StoreContext};
use idem_core::{Engine, InProgress, MemoryStore, OnStoreFailure, Policy, Scope, Store};
use idem_http_suite::{
    HandsATill, PromisesATill, ScenarioAnswer, ScenarioApp, ScenarioRequest, Target, Till,
    assert_route_misconfigured, routes, scenario_tests,
};
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;

/// An actix-web server on its own thread and its own `actix_rt::System`, stopped
/// when dropped.
struct Server {
    addr: SocketAddr,
    handle: ServerHandle,
}

impl Server {
    /// Serves an app configured by `configure` on 127.0.0.1, port 0 (bound by
    /// `idem_http_suite::bind`, with its fixed receive buffer).
    fn start<F>(configure: F) -> Self
    where
        F: Fn(&mut web::ServiceConfig) + Send + Clone + 'static,
    {
        let (started, bound) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix_rt::System::new().block_on(async move {
                let listener = idem_http_suite::bind()
                    .and_then(tokio::net::TcpListener::into_std)
                    .expect("bind 127.0.0.1:0");
                let server = HttpServer::new(move || App::new().configure(configure.clone()))
                    .workers(1)
                    .disable_signals()
                    .shutdown_timeout(1)
                    .listen(listener)
                    .expect("listen on 127.0.0.1:0");
                let addr = server.addrs()[0];
                let server = server.run();
                started
                    .send((addr, server.handle()))
                    .expect("report the address");
                // Ends when the handle stops the server.
                let _ = server.await;
            });
        });
        let (addr, handle) = bound.recv().expect("the server thread started");
        Self { addr, handle }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The command is sent at once; the server thread ends by itself.
        drop(self.handle.stop(false));
    }
}

// ---------------------------------------------------------------------------
// The scenario app, built as idem-http-suite documents it, and the shared suite.
// ---------------------------------------------------------------------------

/// Starts the actix build of the scenario app over `store`.
async fn start_scenario_app(store: Arc<dyn Store>) -> Target {
    let app = ScenarioApp::new();
    let held = Arc::clone(&store);
    let server = Server::start(move |config| {
        config.app_data(web::Data::new(app.clone()));
        config.route("/executions", web::get().to(executions));
        config.route("/gates/{name}", web::post().to(open_gate));
        for route in routes() {
            config.service(
                web::resource(route.path)
                    .wrap(
                        Idempotency::from_engine(Engine::from_shared(
                            Arc::clone(&store),
                            route.policy,
                        ))
                        .scope_from_extension::<Scope>(),
                    )
                    // The app's authentication: it names the principal first.
                    .wrap_fn(|request, service| {
                        let scope = idem_http_suite::principal(
                            request
                                .headers()
                                .get("authorization")
                                .map(|value| value.as_bytes()),
                        );
                        request.extensions_mut().insert(scope);
                        actix_web::dev::Service::call(service, request)
                    })
                    .to(scenario_handler),
            );
        }
    });
    Target::new(
        server.addr,
        Serving {
            server: Some(server),
            store: held,
        },
    )
}

/// The scenario app's server and its store, dropped in that order.
///
/// actix drops each worker's app on the worker's thread after the server has
/// stopped; a store that owns its database (a test cluster, a temporary file)
/// would go with the last app, on a thread the test process may not wait for.
/// So the guard stops the server, waits (a few seconds at most) until actix has
/// dropped every app, and drops the store's last handle itself.
struct Serving {
    server: Option<Server>,
    store: Arc<dyn Store>,
}

impl Drop for Serving {
    fn drop(&mut self) {
        drop(self.server.take());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&self.store) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

scenario_tests!(start_scenario_app);

/// The suite over a fresh SQLite file per case.
mod sqlite {
    use super::start_scenario_app;

    idem_http_suite::scenario_tests!(
        start_scenario_app,
        store = idem_http_suite::stores::sqlite_store
    );
}

/// The suite over a fresh PostgreSQL database per case.
mod postgres {
    use super::start_scenario_app;

    idem_http_suite::scenario_tests!(
        start_scenario_app,
        store = idem_http_suite::stores::postgres_store
    );
}

/// Durable stores beyond the suite: instances sharing one database, and the
/// database going away under a running app.
mod durable {
    use idem_http_suite::durable::{Start, instances_over_one_postgres_database};

    use super::{axum_instance, start_scenario_app};

    idem_http_suite::durable_tests!(start_scenario_app);

    /// One instance of each adapter, each with its own `PgStore` (its own
    /// pool), over one database: 200 concurrent requests with one key, spread
    /// over both.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_actix_and_an_axum_instance_share_one_postgres_database() {
        let actix: Start = |store| Box::pin(start_scenario_app(store));
        let axum: Start = |store| Box::pin(axum_instance::start(store));
        instances_over_one_postgres_database(&[actix, axum]).await;
    }
}

/// The axum build of the scenario app, as idem-axum's tests/http.rs has it,
/// pared down: the instance that shares a database with an actix one.
mod axum_instance {
    use std::convert::Infallible;
    use std::sync::Arc;

    use axum::Router;
    use axum::body::{Body, Bytes};
    use axum::extract::{Path, State};
    use axum::http::header::AUTHORIZATION;
    use axum::http::{HeaderMap, HeaderValue, Method, Uri};
    use axum::response::Response;
    use axum::routing::{any, get, post};
    use idem_axum::IdempotencyLayer;
    use idem_core::{Scope, Store};
    use idem_http_suite::{ScenarioAnswer, ScenarioApp, ScenarioRequest, Target};

    /// Starts it over `store` on 127.0.0.1, port 0.
    pub(super) async fn start(store: Arc<dyn Store>) -> Target {
        let mut router = Router::new()
            .route("/executions", get(executions))
            .route("/gates/{name}", post(open_gate));
        for route in idem_http_suite::routes() {
            let idempotency = IdempotencyLayer::new(Arc::clone(&store), route.policy)
                .scope_with(|parts| Some(principal(&parts.headers)));
            router = router.route(route.path, any(guarded).layer(idempotency));
        }
        let router = router.with_state(ScenarioApp::new());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        });
        Target::new(addr, Serving(server))
    }

    /// Stops the server when the target is dropped.
    struct Serving(tokio::task::JoinHandle<()>);

    impl Drop for Serving {
        fn drop(&mut self) {
            self.0.abort();
        }
    }

    fn principal(headers: &HeaderMap) -> Scope {
        idem_http_suite::principal(headers.get(AUTHORIZATION).map(HeaderValue::as_bytes))
    }

    async fn guarded(
        State(app): State<ScenarioApp>,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response {
        let request = ScenarioRequest {
            method: method.to_string(),
            path: uri.path().to_owned(),
            query: uri.query().unwrap_or("").to_owned(),
            principal: principal(&headers).to_string(),
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
}

/// Every guarded route's handler: [`ScenarioApp::handle`], its answer streamed
/// chunk by chunk.
async fn scenario_handler(
    app: web::Data<ScenarioApp>,
    request: HttpRequest,
    mut payload: web::Payload,
) -> Result<HttpResponse, actix_web::Error> {
    let principal = request
        .extensions()
        .get::<Scope>()
        .map_or_else(|| idem_http_suite::ANONYMOUS.to_owned(), Scope::to_string);
    let mut body = web::BytesMut::new();
    while let Some(chunk) = futures_util::StreamExt::next(&mut payload).await {
        body.extend_from_slice(&chunk?);
    }
    let answer = app
        .handle(ScenarioRequest {
            method: request.method().to_string(),
            path: request.path().to_owned(),
            query: request.query_string().to_owned(),
            principal,
            body: body.freeze(),
        })
        .await;
    Ok(respond(answer))
}

async fn executions(app: web::Data<ScenarioApp>) -> HttpResponse {
    respond(app.executions())
}

async fn open_gate(app: web::Data<ScenarioApp>, name: web::Path<String>) -> HttpResponse {
    respond(app.open_gate(&name))
}

fn respond(answer: ScenarioAnswer) -> HttpResponse {
    let mut response = HttpResponse::build(StatusCode::from_u16(answer.status).unwrap());
    for (name, value) in answer.headers {
        response.append_header((name, value));
    }
    if answer.body.is_empty() {
        return response.finish();
    }
    let chunks = answer
        .body
        .into_iter()
        .map(Ok::<_, std::convert::Infallible>);
    response.streaming(futures_util::stream::iter(chunks))
}

// ---------------------------------------------------------------------------
// What is particular to actix: the extractor, scopes from a closure and from an
// extension set by an outer middleware on a `web::scope`, an inner service that
// fails, a connection reset mid-handler.
// ---------------------------------------------------------------------------

/// The state of the actix-specific app: how many times the handler ran, and a
/// gate it can be held at.
#[derive(Default)]
struct Ledger {
    executions: AtomicU64,
    finished: AtomicU64,
    gate: Notify,
    entered: Notify,
    /// Notified when actix drops (or completes) a `/held` request's service
    /// future: the connection's part of the work is over.
    left: Notify,
}

/// Notifies [`Ledger::left`] when dropped.
struct LeftSignal(web::Data<Ledger>);

impl Drop for LeftSignal {
    fn drop(&mut self) {
        self.0.left.notify_one();
    }
}

/// A handler that is not idempotent by nature: every run counts. It answers what
/// it extracted.
async fn charge(
    ledger: web::Data<Ledger>,
    request: HttpRequest,
    info: Option<ExecutionInfo>,
    body: web::Bytes,
) -> HttpResponse {
    let execution = ledger.executions.fetch_add(1, Ordering::SeqCst) + 1;
    if request.query_string() == "gate" {
        ledger.entered.notify_one();
        ledger.gate.notified().await;
    }
    ledger.finished.fetch_add(1, Ordering::SeqCst);
    HttpResponse::Created()
        .append_header(("x-execution", execution.to_string()))
        .json(serde_json::json!({
            "execution": execution,
            "body": String::from_utf8_lossy(&body),
            "key": info.as_ref().map(|info| info.key().as_str().to_owned()),
            "scope": info.as_ref().map(|info| info.scope().to_string()),
            "guarded": info.as_ref().map(|info| info.is_guarded()),
        }))
}

/// A body of known size, over `/sized`'s stored-body limit.
async fn sized(ledger: web::Data<Ledger>, execution: ExecutionInfo) -> HttpResponse {
    ledger.executions.fetch_add(1, Ordering::SeqCst);
    HttpResponse::Ok()
        .insert_header(("x-key", execution.key().as_str().to_owned()))
        .body(vec![b'y'; 5000])
}

/// The scope of `/charges`: the token of `Authorization: Bearer TOKEN` (a real
/// application checks it first).
fn bearer(request: &HttpRequest) -> Option<Scope> {
    let value = request.headers().get("authorization")?.to_str().ok()?;
    value.strip_prefix("Bearer ").map(Scope::from)
}

/// What the tenants' auth middleware puts in the request's extensions.
#[derive(Clone)]
struct Tenant(String);

impl From<Tenant> for Scope {
    fn from(tenant: Tenant) -> Self {
        Scope::new(tenant.0)
    }
}

fn start(store: Arc<dyn Store>) -> (Server, web::Data<Ledger>) {
    let ledger = web::Data::new(Ledger::default());
    let data = ledger.clone();
    let server = Server::start(move |config| {
        config.app_data(data.clone());
        config.service(
            web::resource("/charges")
                .wrap(Idempotency::new(store.clone(), Policy::required()).scope_with(bearer))
                .route(web::post().to(charge)),
        );
        config.service(
            web::resource("/deposits")
                .wrap(Idempotency::new(store.clone(), Policy::optional()).global_scope())
                .route(web::post().to(charge)),
        );
        config.service(
            web::resource("/held")
                .wrap(
                    Idempotency::new(
                        store.clone(),
                        Policy::required().in_progress(InProgress::Wait {
                            up_to: Duration::from_secs(30),
                        }),
                    )
                    .global_scope(),
                )
                .route(web::post().to(charge))
                .wrap_fn({
                    let ledger = data.clone();
                    move |request, service| {
                        let signal = LeftSignal(ledger.clone());
                        let response = actix_web::dev::Service::call(service, request);
                        async move {
                            let _signal = signal;
                            response.await
                        }
                    }
                }),
        );
        config.service(
            web::resource("/sized")
                .wrap(
                    Idempotency::new(store.clone(), Policy::required().stored_body_limit(1500))
                        .global_scope(),
                )
                .route(web::post().to(sized)),
        );
        config.service(
            web::resource("/guarded-by-inner")
                // An inner middleware that refuses with an `Err` when asked to.
                .wrap_fn(|request, service| {
                    let refuse = request.headers().contains_key("x-refuse");
                    let response = actix_web::dev::Service::call(service, request);
                    async move {
                        if refuse {
                            return Err(actix_web::error::ErrorBadRequest(
                                "refused by the inner middleware",
                            ));
                        }
                        response.await
                    }
                })
                .wrap(Idempotency::new(store.clone(), Policy::required()).global_scope())
                .route(web::post().to(charge)),
        );
        config.service(
            web::scope("/tenants")
                .wrap(
                    Idempotency::new(store.clone(), Policy::required())
                        .scope_from_extension::<Tenant>(),
                )
                // The tenants' auth middleware, registered after so it runs first.
                .wrap_fn(|request, service| {
                    let tenant = request
                        .headers()
                        .get("x-verified-tenant")
                        .and_then(|value| value.to_str().ok())
                        .map(|tenant| Tenant(tenant.to_owned()));
                    if let Some(tenant) = tenant {
                        request.extensions_mut().insert(tenant);
                    }
                    actix_web::dev::Service::call(service, request)
                })
                .route("/charges", web::post().to(charge)),
        );
    });
    (server, ledger)
}

fn memory() -> Arc<dyn Store> {
    Arc::new(MemoryStore::new())
}

fn header_values(response: &reqwest::Response, name: &str) -> Vec<String> {
    response
        .headers()
        .get_all(name)
        .iter()
        .map(|value| value.to_str().unwrap().to_owned())
        .collect()
}

async fn json(response: reqwest::Response) -> serde_json::Value {
    response.json().await.unwrap()
}

#[tokio::test]
async fn the_extractors_give_the_key_the_scope_and_guard() {
    let (server, ledger) = start(memory());
    let send = || {
        reqwest::Client::new()
            .post(server.url("/charges"))
            .header("idempotency-key", "order-1")
            .header("authorization", "Bearer alice")
            .body("{\"amount\":1}")
            .send()
    };
    let first = send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(
        json(first).await,
        serde_json::json!({
            "execution": 1, "body": "{\"amount\":1}", "key": "order-1", "scope": "alice", "guarded": true,
        })
    );
    let retry = send().await.unwrap();
    assert_eq!(header_values(&retry, "idempotent-replayed"), ["true"]);
    assert_eq!(json(retry).await["execution"], 1);

    // An optional route without a key: no info, and every request runs.
    for execution in [2, 3] {
        let response = reqwest::Client::new()
            .post(server.url("/deposits"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            json(response).await,
            serde_json::json!({
                "execution": execution, "body": "", "key": null, "scope": null, "guarded": null,
            })
        );
    }
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_scope_source_that_finds_nothing_is_a_problem_and_nothing_runs() {
    let (server, ledger) = start(memory());
    for path in ["/charges", "/tenants/charges"] {
        let response = reqwest::Client::new()
            .post(server.url(path))
            .header("idempotency-key", "k")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 500, "{path}");
        assert_eq!(
            header_values(&response, "content-type"),
            ["application/problem+json"]
        );
        assert_eq!(
            json(response).await["type"],
            "https://idem.rs/problems/scope-unavailable"
        );
    }
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_scope_comes_from_the_auth_middlewares_extension() {
    let (server, ledger) = start(memory());
    let send = |tenant: &'static str| {
        reqwest::Client::new()
            .post(server.url("/tenants/charges"))
            .header("idempotency-key", "k")
            .header("x-verified-tenant", tenant)
            .send()
    };
    let acme = send("acme").await.unwrap();
    assert_eq!(acme.status(), 201);
    assert_eq!(json(acme).await["scope"], "acme");
    let replay = send("acme").await.unwrap();
    assert_eq!(header_values(&replay, "idempotent-replayed"), ["true"]);
    let globex = send("globex").await.unwrap();
    assert!(globex.headers().get("idempotent-replayed").is_none());
    assert_eq!(json(globex).await["scope"], "globex");
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_inner_service_error_is_answered_as_actix_would_and_releases_the_key() {
    let (server, ledger) = start(memory());
    let send = |refuse: bool| {
        let mut request = reqwest::Client::new()
            .post(server.url("/guarded-by-inner"))
            .header("idempotency-key", "k")
            .body("{}");
        if refuse {
            request = request.header("x-refuse", "1");
        }
        request.send()
    };
    let refused = send(true).await.unwrap();
    assert_eq!(refused.status(), 400);
    assert_eq!(
        refused.text().await.unwrap(),
        "refused by the inner middleware"
    );
    // Not recorded, though a 400 would be: the retry runs the handler.
    let retry = send(false).await.unwrap();
    assert_eq!(retry.status(), 201);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    let replay = send(false).await.unwrap();
    assert_eq!(header_values(&replay, "idempotent-replayed"), ["true"]);
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_connection_reset_mid_handler_does_not_cancel_it() {
    let (server, ledger) = start(memory());
    let entered = ledger.entered.notified();
    let mut client = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    client
        .write_all(b"POST /held?gate HTTP/1.1\r\nhost: idem\r\nidempotency-key: gone\r\ncontent-length: 1\r\n\r\nx")
        .await
        .unwrap();
    entered.await;
    // The client resets the connection while the handler waits at the gate, and
    // actix drops what it was doing for that connection.
    client.set_zero_linger().unwrap();
    drop(client);
    ledger.left.notified().await;
    assert_eq!(ledger.finished.load(Ordering::SeqCst), 0);
    ledger.gate.notify_one();

    // The retry waits for the first execution and replays its answer.
    let retry = reqwest::Client::new()
        .post(server.url("/held?gate"))
        .header("idempotency-key", "gone")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(header_values(&retry, "idempotent-replayed"), ["true"]);
    assert_eq!(header_values(&retry, "x-execution"), ["1"]);
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 1);
    assert_eq!(ledger.finished.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_sized_body_over_the_stored_limit_is_sent_as_it_is_then_not_replayed() {
    let (server, ledger) = start(memory());
    let send = || {
        reqwest::Client::new()
            .post(server.url("/sized"))
            .header("idempotency-key", "big")
            .send()
    };
    let first = send().await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(header_values(&first, "content-length"), ["5000"]);
    assert_eq!(header_values(&first, "x-key"), ["big"]);
    assert_eq!(first.bytes().await.unwrap(), vec![b'y'; 5000]);

    let retry = send().await.unwrap();
    assert_eq!(retry.status(), 410);
    assert_eq!(
        json(retry).await["type"],
        "https://idem.rs/problems/response-not-stored"
    );
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 1);
}

/// The suite over one Redis node and over a Redis Cluster (one of each for the
/// whole binary, a fresh key prefix per case), and an actix and an axum
/// instance sharing the cluster.
mod redis {
    use std::sync::Arc;

    use idem_core::Store;
    use idem_http_suite::durable::one_key_over_instances_executes_once;
    use idem_redis::RedisStore;
    use idem_testkit::TestRedis;

    use super::{axum_instance, start_scenario_app};

    idem_http_suite::scenario_tests!(start_scenario_app, store = redis_store);

    mod cluster {
        use super::super::start_scenario_app;

        idem_http_suite::scenario_tests!(start_scenario_app, store = super::redis_cluster_store);
    }

    async fn redis_store() -> Arc<dyn Store> {
        Arc::new(idem_http_suite::stores::redis_store(TestRedis::shared()).await)
    }

    async fn redis_cluster_store() -> Arc<dyn Store> {
        Arc::new(idem_http_suite::stores::redis_store(TestRedis::shared_cluster()).await)
    }

    /// One instance of each adapter, each with its own `RedisStore` (its own
    /// connections), over the shared Redis Cluster: 200 concurrent requests
    /// with one key, spread over both.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_actix_and_an_axum_instance_share_one_redis_cluster() {
        let redis = TestRedis::shared_cluster();
        let prefix = redis.fresh_prefix();
        let url = redis.url();
        let connect = || RedisStore::builder().prefix(prefix.as_str()).connect(&url);
        let instances = vec![
            start_scenario_app(Arc::new(connect().await.unwrap())).await,
            axum_instance::start(Arc::new(connect().await.unwrap())).await,
        ];
        one_key_over_instances_executes_once(instances).await;
    }
}

async fn with_till(
    till: StoreContext<Till>,
    order: web::Path<String>,
    body: String,
) -> HttpResponse {
    HttpResponse::Ok().body(format!("{} for {order}: {body}", till.name))
}

async fn maybe_till(execution: Option<ExecutionInfo>) -> HttpResponse {
    let till = execution.and_then(|execution| execution.context::<Till>());
    HttpResponse::Ok().body(till.is_some().to_string())
}

async fn key_of(info: ExecutionInfo) -> HttpResponse {
    HttpResponse::Ok().body(info.key().as_str().to_owned())
}

#[actix_web::test]
async fn a_handler_without_the_middleware_cannot_extract_a_key() {
    let app = actix_web::test::init_service(
        App::new().service(web::resource("/bare").route(web::post().to(key_of))),
    )
    .await;
    let request = actix_web::test::TestRequest::post()
        .uri("/bare")
        .insert_header(("idempotency-key", "k-1"))
        .to_request();
    let response = actix_web::test::call_service(&app, request).await;
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|value| value.to_str().unwrap().to_owned());
    let body = actix_web::test::read_body(response).await;
    assert_route_misconfigured(status, content_type.as_deref(), &body);
}

#[actix_web::test]
async fn a_handler_takes_what_its_store_hands_it_typed_or_is_refused() {
    let global = |store| Idempotency::new(store, Policy::required()).global_scope();
    let app = actix_web::test::init_service(
        App::new()
            .service(
                web::resource("/handed/{order}")
                    .route(
                        global(HandsATill(MemoryStore::new()))
                            .on(Method::POST, with_till)
                            .unwrap(),
                    )
                    .route(web::get().to(|| async { HttpResponse::Ok().body("not keyed") })),
            )
            .service(
                web::resource("/promised/{order}").route(
                    Idempotency::new(PromisesATill(MemoryStore::new()), Policy::required())
                        .global_scope()
                        .on(Method::POST, with_till)
                        .unwrap(),
                ),
            )
            .service(
                web::resource("/maybe")
                    .wrap(Idempotency::new(MemoryStore::new(), Policy::required()).global_scope())
                    .route(web::post().to(maybe_till)),
            ),
    )
    .await;
    let post = |uri: &str| {
        actix_web::test::TestRequest::post()
            .uri(uri)
            .insert_header(("idempotency-key", "k-1"))
            .set_payload("{}")
            .to_request()
    };
    let handed = actix_web::test::call_service(&app, post("/handed/o-1")).await;
    assert_eq!(handed.status(), StatusCode::OK);
    assert_eq!(
        actix_web::test::read_body(handed).await,
        "the request's till for o-1: {}"
    );
    // The resource's other routes are its own.
    let get = actix_web::test::TestRequest::get()
        .uri("/handed/o-1")
        .to_request();
    assert_eq!(
        actix_web::test::call_and_read_body(&app, get).await,
        "not keyed"
    );
    // A store that declares a till and hands none: the handler never runs.
    let refused = actix_web::test::call_service(&app, post("/promised/o-1")).await;
    let status = refused.status().as_u16();
    let content_type = refused
        .headers()
        .get("content-type")
        .map(|value| value.to_str().unwrap().to_owned());
    let body = actix_web::test::read_body(refused).await;
    assert_route_misconfigured(status, content_type.as_deref(), &body);
    let maybe = actix_web::test::call_service(&app, post("/maybe")).await;
    assert_eq!(actix_web::test::read_body(maybe).await, "false");
}

/// `on` refuses, as the route is built, a route that would hand the handler
/// no till: the engine's check, answered as it is.
#[test]
fn a_route_that_cannot_hand_what_its_handler_takes_is_refused_when_built() {
    let expected = std::any::type_name::<Till>();
    let refused = |store: Arc<dyn Store>, policy: Policy, method: Method| {
        Idempotency::from_engine(Engine::from_shared(store, policy))
            .global_scope()
            .on(method, with_till)
            .map(|_| ())
            .unwrap_err()
    };
    assert_eq!(
        refused(
            Arc::new(MemoryStore::new()),
            Policy::required(),
            Method::POST
        ),
        ContextRouteError::NotHanded {
            expected,
            handed: None
        }
    );
    let tilled = || Arc::new(HandsATill(MemoryStore::new()));
    assert_eq!(
        refused(tilled(), Policy::optional(), Method::POST),
        ContextRouteError::OptionalKeys { expected }
    );
    assert_eq!(
        refused(
            tilled(),
            Policy::required().on_store_failure(OnStoreFailure::FailOpen),
            Method::POST
        ),
        ContextRouteError::FailsOpen { expected }
    );
    // actix-web routes any method; the policy must cover it.
    let custom = Method::from_bytes(b"CHARGE").unwrap();
    assert_eq!(
        refused(tilled(), Policy::required(), custom.clone()),
        ContextRouteError::MethodNotCovered {
            expected,
            method: "CHARGE".into()
        }
    );
    Idempotency::new(
        HandsATill(MemoryStore::new()),
        Policy::required().methods(["CHARGE"]),
    )
    .global_scope()
    .on(custom, with_till)
    .unwrap();
}
