//! idem-actix over real HTTP on 127.0.0.1: actix's own server, a real client.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix_web::dev::ServerHandle;
use actix_web::{App, HttpMessage, HttpRequest, HttpResponse, HttpServer, web};
use idem_actix::{Idempotency, IdempotencyInfo};
use idem_core::{InProgress, MemoryStore, Policy, Scope, Store};
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;

/// An actix-web server on its own thread and its own `actix_rt::System`, stopped
/// when dropped.
struct Server {
    addr: SocketAddr,
    handle: ServerHandle,
}

impl Server {
    /// Serves an app configured by `configure` on 127.0.0.1, port 0.
    fn start<F>(configure: F) -> Self
    where
        F: Fn(&mut web::ServiceConfig) + Send + Clone + 'static,
    {
        let (started, bound) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix_rt::System::new().block_on(async move {
                let server = HttpServer::new(move || App::new().configure(configure.clone()))
                    .workers(1)
                    .disable_signals()
                    .shutdown_timeout(1)
                    .bind(("127.0.0.1", 0))
                    .expect("bind 127.0.0.1:0");
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

/// The app's state: how many times the handler ran, and a gate it can wait at.
#[derive(Default)]
struct Ledger {
    executions: AtomicU64,
    finished: AtomicU64,
    gate: Notify,
    entered: Notify,
    /// Notified when actix drops (or completes) a `/waiting` request's service
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

/// A handler that is not idempotent by nature: every run counts.
async fn charge(
    ledger: web::Data<Ledger>,
    request: HttpRequest,
    info: Option<IdempotencyInfo>,
    body: web::Bytes,
) -> HttpResponse {
    let execution = ledger.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let query = request.query_string();
    if query.contains("gate") {
        ledger.entered.notify_one();
        ledger.gate.notified().await;
    }
    if query.contains("panic") {
        panic!("the handler panics on purpose");
    }
    ledger.finished.fetch_add(1, Ordering::SeqCst);
    if let Some(size) = query.strip_prefix("big=") {
        let size: usize = size.parse().unwrap();
        let chunks =
            (0..size / 1000).map(|_| Ok::<_, actix_web::Error>(web::Bytes::from(vec![b'x'; 1000])));
        return HttpResponse::Ok().streaming(futures_util::stream::iter(chunks));
    }
    HttpResponse::Created()
        .append_header(("set-cookie", "a=1"))
        .append_header(("set-cookie", "b=2"))
        .append_header(("x-execution", execution.to_string()))
        .json(serde_json::json!({
            "execution": execution,
            "body": String::from_utf8_lossy(&body),
            "key": info.as_ref().map(|info| info.key.as_str().to_owned()),
            "scope": info.as_ref().map(|info| info.scope.to_string()),
            "first": info.as_ref().map(|info| info.first_execution),
        }))
}

/// Names the principal from `Authorization: Bearer TOKEN`, as an auth
/// middleware would after checking the token.
fn principal(request: &HttpRequest) -> Option<Scope> {
    let value = request.headers().get("authorization")?.to_str().ok()?;
    value.strip_prefix("Bearer ").map(Scope::from)
}

#[derive(Clone)]
struct Principal(String);

impl From<Principal> for Scope {
    fn from(principal: Principal) -> Self {
        Scope::new(principal.0)
    }
}

fn start(store: Arc<dyn Store>) -> (Server, web::Data<Ledger>) {
    let ledger = web::Data::new(Ledger::default());
    let data = ledger.clone();
    let server = Server::start(move |config| {
        config.app_data(data.clone());
        config.service(
            web::resource("/charges")
                .wrap(Idempotency::from_shared(store.clone()).scope_fn(principal))
                .route(web::post().to(charge)),
        );
        config.service(
            web::resource("/deposits")
                .wrap(Idempotency::from_shared(store.clone()).optional())
                .route(web::post().to(charge)),
        );
        config.service(
            web::resource("/waiting")
                .wrap(Idempotency::from_shared(store.clone()).policy(
                    Policy::required().in_progress(InProgress::Wait {
                        up_to: Duration::from_secs(30),
                    }),
                ))
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
            web::resource("/small")
                .wrap(
                    Idempotency::from_shared(store.clone()).policy(
                        Policy::required()
                            .request_body_limit(16)
                            .stored_body_limit(1500),
                    ),
                )
                .route(web::post().to(charge)),
        );
        config.service(
            web::scope("/tenants")
                .wrap(Idempotency::from_shared(store.clone()).scope_from_extension::<Principal>())
                .wrap_fn(|request, service| {
                    if let Some(Some(scope)) = request
                        .headers()
                        .get("x-verified-tenant")
                        .map(|value| value.to_str().ok().map(str::to_owned))
                    {
                        request.extensions_mut().insert(Principal(scope));
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

async fn post(url: String, key: Option<&str>, body: &'static str) -> reqwest::Response {
    let mut request = reqwest::Client::new().post(url).body(body);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.send().await.unwrap()
}

fn header_values(response: &reqwest::Response, name: &str) -> Vec<String> {
    response
        .headers()
        .get_all(name)
        .iter()
        .map(|value| value.to_str().unwrap().to_owned())
        .collect()
}

async fn problem_type(response: reqwest::Response) -> String {
    assert_eq!(
        header_values(&response, "content-type"),
        ["application/problem+json"]
    );
    let body: serde_json::Value = response.json().await.unwrap();
    body["type"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn replay_returns_identical_bytes_and_every_header() {
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
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_cookies = header_values(&first, "set-cookie");
    assert_eq!(first_cookies, ["a=1", "b=2"]);
    let first_body = first.bytes().await.unwrap();

    let retry = send().await.unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(header_values(&retry, "idempotent-replayed"), ["true"]);
    assert_eq!(header_values(&retry, "set-cookie"), first_cookies);
    assert_eq!(header_values(&retry, "x-execution"), ["1"]);
    assert_eq!(header_values(&retry, "content-type"), ["application/json"]);
    assert_eq!(retry.bytes().await.unwrap(), first_body);
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 1);

    let body: serde_json::Value = serde_json::from_slice(&first_body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({
            "execution": 1, "body": "{\"amount\":1}", "key": "order-1", "scope": "alice", "first": true,
        })
    );
}

#[tokio::test]
async fn the_same_key_under_two_scopes_is_two_records() {
    let (server, ledger) = start(memory());
    for (token, execution) in [("alice", "1"), ("bob", "2"), ("alice", "1")] {
        let response = reqwest::Client::new()
            .post(server.url("/charges"))
            .header("idempotency-key", "shared")
            .header("authorization", format!("Bearer {token}"))
            .send()
            .await
            .unwrap();
        assert_eq!(header_values(&response, "x-execution"), [execution]);
    }
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_missing_scope_is_a_problem_and_the_handler_does_not_run() {
    let (server, ledger) = start(memory());
    let response = post(server.url("/charges"), Some("k"), "").await;
    assert_eq!(response.status(), 500);
    assert_eq!(
        problem_type(response).await,
        "https://idem.rs/problems/scope-unavailable"
    );

    let response = post(server.url("/tenants/charges"), Some("k"), "").await;
    assert_eq!(response.status(), 500);
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
    let body: serde_json::Value = acme.json().await.unwrap();
    assert_eq!(body["scope"], "acme");
    assert_eq!(
        header_values(&send("acme").await.unwrap(), "idempotent-replayed"),
        ["true"]
    );
    assert_eq!(send("globex").await.unwrap().status(), 201);
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn optional_route_without_key_runs_every_time_and_has_no_info() {
    let (server, ledger) = start(memory());
    for _ in 0..2 {
        let response = post(server.url("/deposits"), None, "x").await;
        assert_eq!(response.status(), 201);
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["key"], serde_json::Value::Null);
    }
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_request_body_over_the_limit_is_refused_before_the_handler() {
    let (server, ledger) = start(memory());
    let response = post(server.url("/small"), Some("k"), "0123456789abcdefg").await;
    assert_eq!(response.status(), 413);
    assert_eq!(
        problem_type(response).await,
        "https://idem.rs/problems/payload-too-large"
    );
    // A streamed body (no Content-Length) is counted as it arrives.
    let chunks = futures_util::stream::iter(["0123456789", "abcdefg"].map(Ok::<_, std::io::Error>));
    let response = reqwest::Client::new()
        .post(server.url("/small"))
        .header("idempotency-key", "k2")
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 0);

    let response = post(server.url("/small"), Some("k"), "0123456789abcdef").await;
    assert_eq!(response.status(), 201);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["body"], "0123456789abcdef");
}

#[tokio::test]
async fn a_response_over_the_stored_limit_is_sent_whole_then_not_replayed() {
    let (server, ledger) = start(memory());
    let first = post(server.url("/small?big=5000"), Some("big"), "").await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.bytes().await.unwrap(), vec![b'x'; 5000]);

    let retry = post(server.url("/small?big=5000"), Some("big"), "").await;
    assert_eq!(retry.status(), 410);
    assert_eq!(
        problem_type(retry).await,
        "https://idem.rs/problems/response-not-stored"
    );
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 1);

    // Within the limit, a streamed body is stored and replayed.
    let first = post(server.url("/small?big=1000"), Some("fits"), "").await;
    assert_eq!(first.bytes().await.unwrap(), vec![b'x'; 1000]);
    let retry = post(server.url("/small?big=1000"), Some("fits"), "").await;
    assert_eq!(header_values(&retry, "idempotent-replayed"), ["true"]);
    assert_eq!(retry.bytes().await.unwrap(), vec![b'x'; 1000]);
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_panicking_handler_releases_its_key() {
    let (server, ledger) = start(memory());
    let response = post(server.url("/waiting?panic"), Some("p"), "").await;
    assert_eq!(response.status(), 500);
    assert_eq!(
        problem_type(response).await,
        "https://idem.rs/problems/handler-failed"
    );
    // The worker survives and the retry runs the handler again.
    let retry = post(server.url("/waiting?panic"), Some("p"), "").await;
    assert_eq!(retry.status(), 500);
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_client_that_disconnects_does_not_cancel_the_handler() {
    let (server, ledger) = start(memory());
    let entered = ledger.entered.notified();
    let mut client = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    client
        .write_all(b"POST /waiting?gate HTTP/1.1\r\nhost: idem\r\nidempotency-key: gone\r\ncontent-length: 1\r\n\r\nx")
        .await
        .unwrap();
    entered.await;
    // The client resets the connection while the handler waits at the gate: the
    // server drops everything it was doing for that connection.
    client.set_zero_linger().unwrap();
    drop(client);
    ledger.left.notified().await;
    assert_eq!(ledger.finished.load(Ordering::SeqCst), 0);
    ledger.gate.notify_one();

    // The retry waits for the first execution and replays its answer.
    let url = server.url("/waiting?gate");
    let retry = post(url, Some("gone"), "x").await;
    assert_eq!(retry.status(), 201);
    assert_eq!(header_values(&retry, "idempotent-replayed"), ["true"]);
    assert_eq!(header_values(&retry, "x-execution"), ["1"]);
    assert_eq!(ledger.executions.load(Ordering::SeqCst), 1);
    assert_eq!(ledger.finished.load(Ordering::SeqCst), 1);
}
