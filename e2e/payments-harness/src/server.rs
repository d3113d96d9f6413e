//! A payments binary as a process on 127.0.0.1, and the HTTP client the trials
//! use on it.

use std::collections::VecDeque;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How many lines of the server's log are kept, for a failure's report.
const LOG_LINES: usize = 40;

/// How many times [`Endpoint::until_final`] sends a request at most.
const MAX_ATTEMPTS: usize = 500;

/// The pause between two attempts of [`Endpoint::until_final`].
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// A guard against a hang: a request unanswered for this long fails (as a
/// transport error, which a retrying client retries), and a server that has
/// not announced itself by then fails the trial with its log.
const HANG: Duration = Duration::from_secs(60);

/// A running server; killed (`SIGKILL`) when dropped.
pub(crate) struct Server {
    child: Child,
    endpoint: Endpoint,
    /// The task reading the server's stderr into the endpoint's log.
    drained: Option<tokio::task::JoinHandle<()>>,
}

/// How to start a server beyond its binary.
#[derive(Clone, Debug)]
pub(crate) struct Launch<'a> {
    /// `--store`; without it, the binary's default (`sqlite://payments.db`,
    /// in [`dir`](Self::dir)).
    pub(crate) store: Option<&'a str>,
    /// The working directory; the test's own without it.
    pub(crate) dir: Option<&'a Path>,
    /// More arguments (`--provider-latency-ms`, `--lease-secs`, …).
    pub(crate) args: Vec<String>,
    /// `RUST_LOG`.
    pub(crate) rust_log: &'a str,
    /// How many lines of its log are kept (the last ones).
    pub(crate) log_lines: usize,
}

impl<'a> Launch<'a> {
    /// On `store`, logging warnings, keeping the last lines for a failure's report.
    pub(crate) fn new(store: &'a str) -> Self {
        Self {
            store: Some(store),
            dir: None,
            args: Vec::new(),
            rust_log: "warn",
            log_lines: LOG_LINES,
        }
    }

    /// On the binary's default store, in `dir`: `sqlite://payments.db` there.
    pub(crate) fn default_store_in(dir: &'a Path) -> Self {
        Self {
            store: None,
            dir: Some(dir),
            ..Self::new("")
        }
    }

    /// With `--name value`.
    pub(crate) fn arg(mut self, name: &str, value: impl ToString) -> Self {
        self.args.push(name.to_owned());
        self.args.push(value.to_string());
        self
    }
}

/// Where a server answers, and a client for it. Cheap to clone: the tasks
/// that send requests while the test kills the server keep one each.
#[derive(Clone)]
pub(crate) struct Endpoint {
    base: String,
    client: reqwest::Client,
    log: Arc<Mutex<VecDeque<String>>>,
}

/// An HTTP answer: status, whether it was a replay, and the body as sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) replayed: bool,
    pub(crate) body: String,
}

/// A request to a keyed route.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Post<'a> {
    /// `/accounts/{account}/charges` or `…/deposits`.
    pub(crate) path: &'a str,
    /// The bearer token; empty: no `Authorization` header.
    pub(crate) principal: &'a str,
    /// The `Idempotency-Key`, if any.
    pub(crate) key: Option<&'a str>,
    /// The JSON body.
    pub(crate) body: &'a str,
}

impl Server {
    /// Starts `binary` on `store` with the provider's latency, and waits for its
    /// `listening on` line.
    pub(crate) async fn start(binary: &Path, store: &str, provider_latency_ms: u64) -> Self {
        Self::launch(
            binary,
            Launch::new(store).arg("--provider-latency-ms", provider_latency_ms),
        )
        .await
    }

    /// Starts `binary` as `launch` says, and waits for its `listening on` line.
    pub(crate) async fn launch(binary: &Path, launch: Launch<'_>) -> Self {
        let log_lines = launch.log_lines;
        let mut command = Command::new(binary);
        command.args(["--listen", "127.0.0.1:0"]);
        if let Some(store) = launch.store {
            command.args(["--store", store]);
        }
        if let Some(dir) = launch.dir {
            command.current_dir(dir);
        }
        let mut child = command
            .args(&launch.args)
            .env_remove("DATABASE_URL")
            .env("RUST_LOG", launch.rust_log)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {}: {error}", binary.display()));
        // The log is read all along, so that a full pipe never blocks the server.
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let drained = child.stderr.take().map(|stderr| {
            let log = Arc::clone(&log);
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let mut log = log.lock().unwrap_or_else(PoisonError::into_inner);
                    if log.len() == log_lines {
                        log.pop_front();
                    }
                    log.push_back(line);
                }
            })
        });
        let first_line = match child.stdout.take() {
            Some(stdout) => {
                let mut lines = BufReader::new(stdout).lines();
                match tokio::time::timeout(HANG, lines.next_line()).await {
                    Ok(line) => line.ok().flatten(),
                    Err(_) => Some(format!("(nothing within {HANG:?})")),
                }
            }
            None => None,
        };
        let base = first_line
            .as_deref()
            .and_then(|line| line.strip_prefix("listening on "))
            .filter(|base| base.starts_with("http://127.0.0.1:"))
            .map(str::to_owned);
        let Some(base) = base else {
            let _ = child.kill().await;
            if let Some(drained) = drained {
                let _ = drained.await;
            }
            panic!(
                "{} did not announce itself (first line {first_line:?}); its log:\n{}",
                binary.display(),
                tail(&log)
            );
        };
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(HANG)
            .build()
            .expect("an HTTP client");
        Self {
            child,
            endpoint: Endpoint { base, client, log },
            drained,
        }
    }

    /// Kills the server with `SIGKILL` and waits for it to be gone.
    pub(crate) async fn kill(mut self) {
        self.child.kill().await.expect("SIGKILL the server");
    }

    /// Kills the server, and answers its log once every line is read (as many
    /// as its [`Launch`] keeps).
    pub(crate) async fn kill_and_read_log(mut self) -> String {
        self.child.kill().await.expect("SIGKILL the server");
        if let Some(drained) = self.drained.take() {
            drained.await.expect("the log reader");
        }
        self.endpoint.log()
    }

    /// Where it answers.
    pub(crate) fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }
}

impl Endpoint {
    /// The last lines of the server's log.
    pub(crate) fn log(&self) -> String {
        tail(&self.log)
    }

    /// Sends `post` once.
    pub(crate) async fn post(&self, post: Post<'_>) -> Result<Reply, reqwest::Error> {
        let mut request = self
            .client
            .post(format!("{}{}", self.base, post.path))
            .header("content-type", "application/json")
            .body(post.body.to_owned());
        if !post.principal.is_empty() {
            request = request.bearer_auth(post.principal);
        }
        if let Some(key) = post.key {
            request = request.header("idempotency-key", key);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        // `Idempotent-Replayed: true` on a replay, and no such header otherwise.
        let replayed = match response.headers().get("idempotent-replayed") {
            None => false,
            Some(value) if value == "true" => true,
            Some(value) => panic!("{post:?}: Idempotent-Replayed: {value:?}"),
        };
        let body = response.text().await?;
        Ok(Reply {
            status,
            replayed,
            body,
        })
    }

    /// Sends `post` until it gets an answer that is not `409`, `503` or a
    /// transport error, as a client that retries with its key does.
    pub(crate) async fn until_final(&self, post: Post<'_>) -> Reply {
        let mut last = None;
        for _ in 0..MAX_ATTEMPTS {
            match self.post(post).await {
                Ok(reply) if !matches!(reply.status, 409 | 503) => return reply,
                Ok(reply) => last = Some(format!("{reply:?}")),
                Err(error) => last = Some(crate::error_chain(&error)),
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        panic!(
            "{post:?}: no final answer in {MAX_ATTEMPTS} attempts, the last {last:?}; the server's log:\n{}",
            self.log()
        );
    }

    /// `GET /accounts/{account}` as `(balance, operations)`; the view must be
    /// exactly `{"account_id", "balance", "operations"}`.
    pub(crate) async fn account(&self, account: &str) -> (i64, u64) {
        let response = self
            .client
            .get(format!("{}/accounts/{account}", self.base))
            .bearer_auth("alice")
            .send()
            .await
            .expect("GET the account");
        assert_eq!(response.status(), 200, "GET /accounts/{account}");
        let view: serde_json::Value = response.json().await.expect("the account as JSON");
        assert_eq!(view["account_id"], account, "{view}");
        let balance = view["balance"].as_i64().expect("a balance");
        let operations = view["operations"].as_u64().expect("an operation count");
        assert_eq!(
            view,
            serde_json::json!({"account_id": account, "balance": balance, "operations": operations})
        );
        (balance, operations)
    }
}

fn tail(log: &Mutex<VecDeque<String>>) -> String {
    let log = log.lock().unwrap_or_else(PoisonError::into_inner);
    log.iter().cloned().collect::<Vec<_>>().join("\n")
}

/// A directory of its own under the system's temporary directory, removed
/// when dropped (a failed trial's too).
pub(crate) struct Scratch(idem_testkit::TempDir);

impl Scratch {
    /// A new, empty directory whose name starts with `idem-PREFIX`.
    pub(crate) fn new(prefix: &str) -> Self {
        Self(
            idem_testkit::TempDir::new(prefix)
                .unwrap_or_else(|error| panic!("a directory for {prefix}: {error}")),
        )
    }

    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        self.0.path()
    }

    /// `sqlite://` and a database file in the directory.
    pub(crate) fn sqlite(&self) -> String {
        format!("sqlite://{}", self.0.file("payments.db"))
    }
}

/// `binary --help`'s standard output; the command must succeed.
pub(crate) async fn help(binary: &Path) -> String {
    let output = Command::new(binary)
        .arg("--help")
        .output()
        .await
        .unwrap_or_else(|error| panic!("run {} --help: {error}", binary.display()));
    assert!(output.status.success(), "--help: {output:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}
