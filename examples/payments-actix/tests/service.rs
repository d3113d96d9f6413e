//! payments-actix over real HTTP: the binary as a process, and the app in process
//! (actix's own server on 127.0.0.1) for the rest of CONTRACT §8.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use actix_web::HttpServer;
use actix_web::dev::ServerHandle;
use idem_core::MemoryStore;
use payments::{Guards, Ledger, Payments};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

/// The app on 127.0.0.1, on its own thread and `actix_rt::System`; stops when
/// dropped.
struct Service {
    base: String,
    server: ServerHandle,
    client: reqwest::Client,
}

impl Drop for Service {
    fn drop(&mut self) {
        // The command is sent at once; the server thread ends by itself.
        drop(self.server.stop(false));
    }
}

impl Service {
    fn start(provider_latency: Duration) -> Self {
        let (started, bound) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let guards = Guards::plain(Arc::new(MemoryStore::new()));
                let payments = Payments::new(Ledger::memory(), provider_latency);
                let server =
                    HttpServer::new(move || payments_actix::app(guards.clone(), payments.clone()))
                        .workers(1)
                        .disable_signals()
                        .bind(("127.0.0.1", 0))
                        .unwrap();
                let addr = server.addrs()[0];
                let server = server.run();
                started.send((addr, server.handle())).unwrap();
                let _ = server.await;
            });
        });
        let (addr, server) = bound.recv().unwrap();
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        Self {
            base: format!("http://{addr}"),
            server,
            client,
        }
    }

    async fn post(
        &self,
        path: &str,
        principal: Option<&str>,
        key: Option<&str>,
        body: &str,
    ) -> (u16, Value) {
        let mut request = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(principal) = principal {
            request = request.bearer_auth(principal);
        }
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let response = request.send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    async fn account(&self, account: &str) -> Value {
        let response = self
            .client
            .get(format!("{}/accounts/{account}", self.base))
            .bearer_auth("alice")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.json().await.unwrap()
    }
}

const BODY: &str = r#"{"amount": 100, "currency": "EUR"}"#;

/// The binary, started in `dir` with `args`, and its base URL.
async fn spawn_binary(dir: &Path, args: &[&str]) -> (tokio::process::Child, String) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_payments-actix"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("DATABASE_URL")
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let first_line = BufReader::new(stdout)
        .lines()
        .next_line()
        .await
        .unwrap()
        .unwrap();
    let base = first_line.strip_prefix("listening on ").unwrap().to_owned();
    assert!(base.starts_with("http://127.0.0.1:"), "{first_line}");
    (child, base)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn charge_once(base: &str) -> reqwest::Response {
    client()
        .post(format!("{base}/accounts/acct-1/charges"))
        .bearer_auth("alice")
        .header("idempotency-key", "order-1")
        .body(BODY)
        .send()
        .await
        .unwrap()
}

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("payments-actix-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_charges_once_per_key_on_the_memory_store() {
    let scratch = Scratch::new();
    let (mut child, base) = spawn_binary(&scratch.0, &["--store", "memory"]).await;
    let first = charge_once(&base).await;
    assert_eq!(first.status(), 201);
    let first: Value = first.json().await.unwrap();
    let retry = charge_once(&base).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.json::<Value>().await.unwrap(), first);
    let account: Value = client()
        .get(format!("{base}/accounts/acct-1"))
        .bearer_auth("alice")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        account,
        json!({"account_id": "acct-1", "balance": 100, "operations": 1})
    );
    child.kill().await.unwrap();
    assert!(!scratch.0.join("payments.db").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_sqlite_store_keeps_records_and_ledger_across_a_restart() {
    let scratch = Scratch::new();
    let (mut child, base) = spawn_binary(&scratch.0, &[]).await;
    let first = charge_once(&base).await;
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Value = first.json().await.unwrap();
    child.kill().await.unwrap();
    assert!(scratch.0.join("payments.db").exists());

    let (mut child, base) = spawn_binary(&scratch.0, &[]).await;
    // The ledger is in the same file: the charge is still there, once.
    let charged_once = json!({"account_id": "acct-1", "balance": 100, "operations": 1});
    assert_eq!(account_of(&base).await, charged_once);
    let retry = charge_once(&base).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.json::<Value>().await.unwrap(), first);
    assert_eq!(account_of(&base).await, charged_once);
    child.kill().await.unwrap();
}

/// `GET /accounts/acct-1` of the binary at `base`.
async fn account_of(base: &str) -> Value {
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!("{base}/accounts/acct-1"))
        .bearer_auth("alice")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

#[tokio::test]
async fn the_help_lists_retention_and_cleanup_interval_with_their_defaults() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_payments-actix"))
        .arg("--help")
        .output()
        .await
        .unwrap();
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    let line_of = |flag: &str| {
        let mut lines = help
            .lines()
            .skip_while(|line| !line.trim().starts_with(flag));
        assert!(lines.next().is_some(), "{flag} not in\n{help}");
        lines.next().unwrap_or_default().to_owned()
    };
    assert!(
        line_of("--retention-secs <RETENTION_SECS>").ends_with("[default: 86400]"),
        "{help}"
    );
    assert!(
        line_of("--cleanup-interval-secs <CLEANUP_INTERVAL_SECS>").ends_with("[default: 60]"),
        "{help}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_retried_after_its_retention_runs_afresh() {
    let scratch = Scratch::new();
    let flags = ["--retention-secs", "1", "--cleanup-interval-secs", "1"];
    let (mut child, base) = spawn_binary(&scratch.0, &flags).await;
    let first = charge_once(&base).await;
    assert_eq!(first.status(), 201);
    let retry = charge_once(&base).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    // Past the retention (and a sweep of the cleanup job), the key is new again.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let later = charge_once(&base).await;
    assert_eq!(later.status(), 201);
    assert!(later.headers().get("idempotent-replayed").is_none());
    assert_eq!(
        account_of(&base).await,
        json!({"account_id": "acct-1", "balance": 200, "operations": 2})
    );
    child.kill().await.unwrap();
}

#[tokio::test]
async fn the_binary_refuses_an_unknown_store() {
    let scratch = Scratch::new();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_payments-actix"))
        .args(["--listen", "127.0.0.1:0", "--store", "mysql://localhost"])
        .current_dir(&scratch.0)
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    assert!(output.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("unknown store \"mysql://localhost\""),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_answers_its_receipt() {
    let service = Service::start(Duration::ZERO);
    let (status, receipt) = service
        .post("/accounts/acct-1/charges", Some("alice"), Some("c-1"), BODY)
        .await;
    assert_eq!(status, 201);
    let id = receipt["id"].as_str().unwrap();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    assert_eq!(
        receipt,
        json!({"id": id, "account_id": "acct-1", "amount": 100, "currency": "EUR", "balance": 100})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_needs_a_key_and_a_principal() {
    let service = Service::start(Duration::ZERO);
    let (status, problem) = service
        .post("/accounts/acct-1/charges", Some("alice"), None, BODY)
        .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (400, Some("https://idem.rs/problems/missing-key"))
    );
    let (status, problem) = service
        .post("/accounts/acct-1/charges", None, Some("c-1"), BODY)
        .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (401, Some("https://idem.rs/problems/unauthorized"))
    );
    assert_eq!(service.account("acct-1").await["operations"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deposits_without_a_key_take_effect_every_time() {
    let service = Service::start(Duration::ZERO);
    for _ in 0..3 {
        let (status, _) = service
            .post("/accounts/acct-1/deposits", Some("alice"), None, BODY)
            .await;
        assert_eq!(status, 201);
    }
    for _ in 0..3 {
        let (status, _) = service
            .post(
                "/accounts/acct-1/deposits",
                Some("alice"),
                Some("d-1"),
                BODY,
            )
            .await;
        assert_eq!(status, 201);
    }
    assert_eq!(
        service.account("acct-1").await,
        json!({"account_id": "acct-1", "balance": 400, "operations": 4})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_body_is_a_400_problem_and_is_replayed() {
    let service = Service::start(Duration::ZERO);
    let bad = r#"{"amount": 0, "currency": "EUR"}"#;
    for _ in 0..2 {
        let (status, problem) = service
            .post(
                "/accounts/acct-1/charges",
                Some("alice"),
                Some("bad-1"),
                bad,
            )
            .await;
        assert_eq!(status, 400);
        assert_eq!(problem["type"], "https://idem.rs/problems/invalid-request");
    }
    assert_eq!(service.account("acct-1").await["operations"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn principals_do_not_share_keys() {
    let service = Service::start(Duration::ZERO);
    let (_, alice) = service
        .post(
            "/accounts/acct-1/charges",
            Some("alice"),
            Some("same"),
            BODY,
        )
        .await;
    let (_, bob) = service
        .post("/accounts/acct-1/charges", Some("bob"), Some("same"), BODY)
        .await;
    assert_ne!(alice["id"], bob["id"]);
    assert_eq!(service.account("acct-1").await["balance"], 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_charges_with_one_key_charge_once() {
    let service = Arc::new(Service::start(Duration::from_millis(200)));
    let attempts: Vec<_> = (0..20)
        .map(|_| {
            let service = Arc::clone(&service);
            tokio::spawn(async move {
                service
                    .post(
                        "/accounts/acct-1/charges",
                        Some("alice"),
                        Some("crowd"),
                        BODY,
                    )
                    .await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for attempt in attempts {
        statuses.push(attempt.await.unwrap().0);
    }
    assert!(
        statuses.iter().all(|status| matches!(status, 201 | 409)),
        "{statuses:?}"
    );
    assert!(statuses.contains(&201));
    assert_eq!(
        service.account("acct-1").await,
        json!({"account_id": "acct-1", "balance": 100, "operations": 1})
    );
}
