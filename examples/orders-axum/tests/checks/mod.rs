//! What both getting-started examples must do, checked on the binary itself:
//! started as a user starts it, on a fresh SQLite file and a free port, driven
//! over HTTP, then stopped with SIGTERM. orders-actix's test includes this file.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use reqwest::StatusCode;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The example binary, running.
pub(crate) struct Server {
    child: Child,
    pub(crate) base: String,
    dir: PathBuf,
}

impl Server {
    /// Starts `binary` on 127.0.0.1, port 0, with a new database file, and
    /// waits for its `listening on http://ADDR` line.
    pub(crate) async fn start(binary: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "idem-orders-{}-{}",
            std::process::id(),
            binary.rsplit('/').next().unwrap_or("example")
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = Command::new(binary)
            .args(["--listen", "127.0.0.1:0", "--database"])
            .arg(format!("sqlite://{}", dir.join("orders.db").display()))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {binary}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let mut first = String::new();
        tokio::time::timeout(
            Duration::from_secs(30),
            BufReader::new(stdout).read_line(&mut first),
        )
        .await
        .expect("the listening line within 30 s")
        .unwrap();
        let addr = first
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("the first line is {first:?}"));
        Self {
            child,
            base: format!("http://{addr}"),
            dir,
        }
    }

    /// Sends SIGTERM and answers whether the server exited cleanly.
    pub(crate) async fn stop(mut self) -> bool {
        let pid = self.child.id().unwrap();
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let status = tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .expect("the server stops within 15 s of SIGTERM")
            .unwrap();
        let _ = std::fs::remove_dir_all(&self.dir);
        status.success()
    }
}

fn order(client: &reqwest::Client, base: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
    client
        .post(format!("{base}/orders"))
        .bearer_auth("alice-token")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
}

/// 401 without a token; an order; its replay; 20 parallel duplicates making
/// one order; a clean stop on SIGTERM.
pub(crate) async fn orders_are_made_once(binary: &str) {
    let server = Server::start(binary).await;
    let base = server.base.clone();
    let client = reqwest::Client::new();

    let anonymous = client
        .post(format!("{base}/orders"))
        .header("idempotency-key", "order-1")
        .body(r#"{"item":"tea","quantity":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        anonymous.headers()["content-type"],
        "application/problem+json"
    );
    let problem: serde_json::Value = anonymous.json().await.unwrap();
    assert_eq!(problem["status"], 401);

    let body = r#"{"item":"tea","quantity":2}"#;
    let first = order(&client, &base, "order-1", body).send().await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_body = first.text().await.unwrap();
    let created: serde_json::Value = serde_json::from_str(&first_body).unwrap();
    assert_eq!(created["item"], "tea");
    assert_eq!(created["quantity"], 2);

    let retry = order(&client, &base, "order-1", body).send().await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.text().await.unwrap(), first_body);

    // 20 duplicates at once: one runs; the others are replayed its answer or,
    // while it runs, told `409` with `Retry-After` (the default policy).
    let body = r#"{"item":"cake","quantity":1}"#;
    let duplicates = (0..20).map(|_| {
        let request = order(&client, &base, "order-2", body);
        tokio::spawn(async move {
            let response = request.send().await.unwrap();
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let retry_after = response.headers().contains_key("retry-after");
            (
                status,
                replayed,
                retry_after,
                response.text().await.unwrap(),
            )
        })
    });
    let mut answers = Vec::new();
    for duplicate in duplicates.collect::<Vec<_>>() {
        answers.push(duplicate.await.unwrap());
    }
    let executed: Vec<_> = answers
        .iter()
        .filter(|(status, replayed, _, _)| *status == StatusCode::CREATED && !replayed)
        .collect();
    assert_eq!(executed.len(), 1, "{answers:?}");
    let cake = &executed[0].3;
    for (status, replayed, retry_after, text) in &answers {
        match *status {
            StatusCode::CREATED => assert_eq!(text, cake, "replayed: {replayed}"),
            StatusCode::CONFLICT => assert!(retry_after, "a 409 says when to retry"),
            other => panic!("a duplicate was answered {other}: {text}"),
        }
    }

    let listed: serde_json::Value = client
        .get(format!("{base}/orders"))
        .bearer_auth("alice-token")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let items: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|order| order["item"].as_str().unwrap())
        .collect();
    assert_eq!(items, ["tea", "cake"], "one order per key");

    assert!(server.stop().await, "a clean exit on SIGTERM");
}
