//! The suite's HTTP client: requests as the cases write them, answers as they
//! compare them.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{PROBLEM_CONTENT_TYPE, REPLAYED_HEADER};
use reqwest::header::{HeaderName, HeaderValue};

use crate::Target;

/// How long a case waits for the app to reach a state it polls for before it
/// gives up. Generous: it bounds a loop, it asserts nothing about speed.
const PATIENCE: Duration = Duration::from_secs(30);

/// A client of one scenario app. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Client {
    http: reqwest::Client,
    base: String,
}

/// One request, built by a case.
#[derive(Clone, Debug)]
pub(crate) struct Call {
    method: reqwest::Method,
    path: String,
    keys: Vec<Vec<u8>>,
    principal: Option<String>,
    body: CallBody,
}

#[derive(Clone, Debug)]
enum CallBody {
    Whole(Bytes),
    Chunks(Vec<Bytes>),
}

/// An answer as the client got it: status, every header in order, the whole body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) body: Bytes,
}

/// The counters of `GET /executions`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Executions {
    pub(crate) started: u64,
    pub(crate) finished: u64,
}

impl Client {
    pub(crate) fn new(target: &Target) -> Self {
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap_or_else(|error| panic!("cannot build the HTTP client: {error}"));
        Self {
            http,
            base: target.base().to_owned(),
        }
    }

    /// Sends `call` and reads the whole answer.
    pub(crate) async fn send(&self, call: &Call) -> Answer {
        let response = self
            .request(call)
            .send()
            .await
            .unwrap_or_else(|error| panic!("{} {} failed: {error}", call.method, call.path));
        read(response, call).await
    }

    fn request(&self, call: &Call) -> reqwest::RequestBuilder {
        let mut request = self
            .http
            .request(call.method.clone(), format!("{}{}", self.base, call.path));
        for key in &call.keys {
            let value = HeaderValue::from_bytes(key)
                .unwrap_or_else(|error| panic!("the key {key:?} cannot be sent: {error}"));
            request = request.header(HeaderName::from_static("idempotency-key"), value);
        }
        if let Some(principal) = &call.principal {
            request = request.bearer_auth(principal);
        }
        match &call.body {
            CallBody::Whole(body) => request.body(body.clone()),
            CallBody::Chunks(chunks) => {
                let chunks: Vec<Result<Bytes, std::io::Error>> =
                    chunks.iter().cloned().map(Ok).collect();
                request.body(reqwest::Body::wrap_stream(futures_util::stream::iter(
                    chunks,
                )))
            }
        }
    }

    /// `GET /executions`.
    pub(crate) async fn executions(&self) -> Executions {
        let answer = self.send(&Call::new("GET", "/executions")).await;
        assert_eq!(answer.status, 200, "GET /executions: {answer:?}");
        let json = answer.json();
        let count = |name: &str| {
            json[name]
                .as_u64()
                .unwrap_or_else(|| panic!("GET /executions has no {name}: {json}"))
        };
        Executions {
            started: count("started"),
            finished: count("finished"),
        }
    }

    /// `POST /gates/{name}`.
    pub(crate) async fn open_gate(&self, name: &str) {
        let answer = self
            .send(&Call::new("POST", &format!("/gates/{name}")))
            .await;
        assert_eq!(answer.status, 204, "POST /gates/{name}: {answer:?}");
    }

    /// Polls `GET /executions` until `reached` holds; panics past [`PATIENCE`].
    pub(crate) async fn await_executions(
        &self,
        what: &str,
        reached: impl Fn(Executions) -> bool,
    ) -> Executions {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let executions = self.executions().await;
            if reached(executions) {
                return executions;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the app never reached: {what} (last seen {executions:?})"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until `n` handlers have started.
    pub(crate) async fn await_started(&self, n: u64) -> Executions {
        self.await_executions(&format!("{n} handler(s) started"), |e| e.started >= n)
            .await
    }
}

async fn read(response: reqwest::Response, call: &Call) -> Answer {
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect();
    let body = response.bytes().await.unwrap_or_else(|error| {
        panic!("the body of {} {} failed: {error}", call.method, call.path)
    });
    Answer {
        status,
        headers,
        body,
    }
}

impl Call {
    /// A `method` request to `path` (with its query), without key or body.
    pub(crate) fn new(method: &str, path: &str) -> Self {
        Self {
            method: reqwest::Method::from_bytes(method.as_bytes())
                .unwrap_or_else(|error| panic!("bad method {method}: {error}")),
            path: path.to_owned(),
            keys: Vec::new(),
            principal: None,
            body: CallBody::Whole(Bytes::new()),
        }
    }

    /// A `POST` to `path` with `key` and `body`.
    pub(crate) fn post(path: &str, key: &str, body: &str) -> Self {
        Self::new("POST", path)
            .key(key)
            .body(Bytes::copy_from_slice(body.as_bytes()))
    }

    /// Adds an `Idempotency-Key` field (call twice for two fields).
    pub(crate) fn key(self, key: &str) -> Self {
        self.raw_key(key.as_bytes())
    }

    /// Adds an `Idempotency-Key` field with these exact bytes.
    pub(crate) fn raw_key(mut self, key: &[u8]) -> Self {
        self.keys.push(key.to_vec());
        self
    }

    /// Sends `Authorization: Bearer principal`.
    pub(crate) fn principal(mut self, principal: &str) -> Self {
        self.principal = Some(principal.to_owned());
        self
    }

    /// The body, sent whole (with a `Content-Length`).
    pub(crate) fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = CallBody::Whole(body.into());
        self
    }

    /// The body, streamed in these chunks (chunked transfer encoding, no
    /// `Content-Length`).
    pub(crate) fn chunked(mut self, chunks: Vec<Bytes>) -> Self {
        self.body = CallBody::Chunks(chunks);
        self
    }
}

impl Answer {
    /// The values of every field named `name`, in order.
    pub(crate) fn values(&self, name: &str) -> Vec<&[u8]> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    /// The single value of `name` as text; panics unless there is exactly one.
    pub(crate) fn header(&self, name: &str) -> String {
        match self.values(name).as_slice() {
            [value] => String::from_utf8_lossy(value).into_owned(),
            values => panic!("expected one {name} field, found {values:?} in {self:?}"),
        }
    }

    /// Whether it carries `Idempotent-Replayed: true`.
    pub(crate) fn is_replay(&self) -> bool {
        match self.values(REPLAYED_HEADER).as_slice() {
            [] => false,
            [b"true"] => true,
            values => panic!("unexpected {REPLAYED_HEADER} fields {values:?}"),
        }
    }

    /// The body as JSON.
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|error| {
            panic!(
                "the body is not JSON ({error}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The handler's execution number (the `x-execution` header).
    pub(crate) fn execution(&self) -> u64 {
        let value = self.header("x-execution");
        value
            .parse()
            .unwrap_or_else(|_| panic!("x-execution is not a number: {value:?}"))
    }

    /// The header fields that belong to the answer itself (without the
    /// connection-level ones the server writes), in order.
    pub(crate) fn own_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.headers
            .iter()
            .filter(|(name, _)| !idem_testkit::is_framing_header(name))
            .cloned()
            .collect()
    }
}

/// Asserts that `answer` is a fresh handler answer (not a replay) with `status`.
pub(crate) fn assert_executed(answer: &Answer, status: u16) {
    assert_eq!(answer.status, status, "unexpected answer: {answer:?}");
    assert!(
        !answer.is_replay(),
        "a first answer is marked replayed: {answer:?}"
    );
}

/// Asserts that `replay` is `first` replayed: the same status and body byte for
/// byte, every header of `first` (the values of each name in the same order),
/// plus `Idempotent-Replayed: true`.
///
/// The order *between* names is not compared: actix-web keeps headers in a hash
/// map seeded per map, so two answers with the same fields list them in
/// different orders on the wire; what is kept is each name's values in order.
pub(crate) fn assert_replay_of(replay: &Answer, first: &Answer) {
    assert!(
        !first.is_replay(),
        "the first answer is marked replayed: {first:?}"
    );
    assert!(replay.is_replay(), "not marked as a replay: {replay:?}");
    assert_eq!(replay.status, first.status, "replayed status");
    assert_eq!(replay.body, first.body, "replayed body");
    let replayed: Vec<_> = replay
        .own_headers()
        .into_iter()
        .filter(|(name, _)| name != REPLAYED_HEADER)
        .collect();
    assert_eq!(
        by_name(replayed),
        by_name(first.own_headers()),
        "replayed headers"
    );
}

/// The fields grouped by name; a stable sort keeps each name's values in order.
fn by_name(mut headers: Vec<(String, Vec<u8>)>) -> Vec<(String, Vec<u8>)> {
    headers.sort_by(|a, b| a.0.cmp(&b.0));
    headers
}

/// Asserts that `answer` is an RFC 9457 problem of `status` whose `type` ends
/// in `/slug`, and answers its JSON.
pub(crate) fn assert_problem(answer: &Answer, status: u16, slug: &str) -> serde_json::Value {
    assert_eq!(answer.status, status, "unexpected answer: {answer:?}");
    assert_eq!(
        answer.header("content-type"),
        PROBLEM_CONTENT_TYPE,
        "problem content type"
    );
    let json = answer.json();
    let kind = json["type"].as_str().unwrap_or_default();
    assert!(
        kind.ends_with(&format!("/{slug}")),
        "problem type {kind:?} does not end in /{slug}: {json}"
    );
    assert!(
        json["title"]
            .as_str()
            .is_some_and(|title| !title.is_empty()),
        "problem without title: {json}"
    );
    assert_eq!(
        json["status"],
        serde_json::json!(status),
        "problem status: {json}"
    );
    assert!(json["detail"].is_string(), "problem without detail: {json}");
    json
}
