//! The scenario app: the routes, policies and handler behaviour that every
//! adapter's build of it shares.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use idem_core::{InProgress, OnStoreFailure, Policy, Scope};
use tokio::sync::watch;

/// The scope of requests that carry no `Authorization: Bearer` header.
pub const ANONYMOUS: &str = "anonymous";

/// The size of the chunks a `body_bytes` answer is streamed in.
pub const CHUNK_BYTES: usize = 16 * 1024;

/// The request body limit and the stored-body limit of the `/limited` route.
pub const LIMITED_BYTES: usize = 1024;

/// One guarded route of the scenario app: its path and its policy.
///
/// Every route answers every method with [`ScenarioApp::handle`] behind the
/// adapter's idempotency middleware configured with `policy`, scoped by
/// [`principal`].
#[derive(Clone, Debug)]
pub struct ScenarioRoute {
    /// The path, e.g. `/required`.
    pub path: &'static str,
    /// The policy of the route's idempotency middleware.
    pub policy: Policy,
}

/// The guarded routes of the scenario app (see the crate docs for the table).
///
/// ```
/// let routes = idem_http_suite::routes();
/// assert_eq!(routes[0].path, "/required");
/// assert!(routes.iter().all(|route| route.path.starts_with('/')));
/// ```
pub fn routes() -> Vec<ScenarioRoute> {
    vec![
        ScenarioRoute {
            path: "/required",
            policy: Policy::required(),
        },
        ScenarioRoute {
            path: "/optional",
            policy: Policy::optional(),
        },
        ScenarioRoute {
            path: "/wait",
            policy: Policy::required().in_progress(InProgress::Wait {
                up_to: Duration::from_secs(30),
            }),
        },
        ScenarioRoute {
            path: "/wait-briefly",
            policy: Policy::required().in_progress(InProgress::Wait {
                up_to: Duration::from_millis(200),
            }),
        },
        ScenarioRoute {
            path: "/limited",
            policy: Policy::required()
                .request_body_limit(LIMITED_BYTES)
                .stored_body_limit(LIMITED_BYTES),
        },
        ScenarioRoute {
            path: "/short-lease",
            policy: Policy::required().lease(Duration::from_secs(1)),
        },
        ScenarioRoute {
            path: "/quick-body",
            policy: Policy::required().request_body_timeout(Duration::from_millis(500)),
        },
        ScenarioRoute {
            path: "/long-lease",
            policy: Policy::required().lease(Duration::from_secs(3600)),
        },
        ScenarioRoute {
            path: "/fail-open",
            policy: Policy::required().on_store_failure(OnStoreFailure::FailOpen),
        },
    ]
}

/// The idempotency scope of a scenario request, from its `Authorization` header:
/// the token of `Bearer TOKEN`, else [`ANONYMOUS`].
///
/// (The scenario app trusts the token as an authenticated principal; a real
/// application authenticates it first.)
///
/// ```
/// use idem_http_suite::principal;
///
/// assert_eq!(principal(Some(b"Bearer alice")).as_str(), "alice");
/// assert_eq!(principal(None).as_str(), "anonymous");
/// ```
pub fn principal(authorization: Option<&[u8]>) -> Scope {
    authorization
        .and_then(|value| value.strip_prefix(b"Bearer "))
        .and_then(|token| std::str::from_utf8(token).ok())
        .map(str::trim)
        .filter(|token| !token.is_empty())
        .map_or_else(|| Scope::new(ANONYMOUS), Scope::new)
}

/// The state and behaviour of one running scenario app. Cheap to clone; every
/// clone shares the counters and gates.
#[derive(Clone, Debug, Default)]
pub struct ScenarioApp {
    state: Arc<State>,
}

#[derive(Debug, Default)]
struct State {
    started: AtomicU64,
    finished: AtomicU64,
    gates: Mutex<HashMap<String, watch::Sender<bool>>>,
}

/// What a guarded route's handler is given.
#[derive(Clone, Debug)]
pub struct ScenarioRequest {
    /// The method, e.g. `POST`.
    pub method: String,
    /// The path, e.g. `/required`.
    pub path: String,
    /// The query string without `?` (empty when absent).
    pub query: String,
    /// The request's scope, as [`principal`] named it.
    pub principal: String,
    /// The whole request body.
    pub body: Bytes,
}

/// What the adapter sends: the status, every header in order (repeats kept), and
/// the body as chunks to be streamed one after the other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScenarioAnswer {
    /// The status code.
    pub status: u16,
    /// The header fields, in order.
    pub headers: Vec<(&'static str, String)>,
    /// The body, in the chunks it is to be streamed in.
    pub body: Vec<Bytes>,
}

impl ScenarioApp {
    /// A fresh app: no executions, every gate closed.
    pub fn new() -> Self {
        Self::default()
    }

    /// The handler of every guarded route. See the crate docs for what the query
    /// parameters do.
    ///
    /// # Panics
    ///
    /// With `panic=true` in the query, on purpose: the scenario of a panicking
    /// handler.
    pub async fn handle(&self, request: ScenarioRequest) -> ScenarioAnswer {
        let execution = self.state.started.fetch_add(1, Ordering::SeqCst) + 1;
        let params = Params::parse(&request.query);
        if let Some(gate) = params.gate {
            let mut open = self.gate(gate).subscribe();
            // The sender lives in the app's map, so the channel never closes.
            let _ = open.wait_for(|open| *open).await;
        }
        if params.delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(params.delay_ms)).await;
        }
        if params.panic {
            panic!("the scenario handler panics on purpose (panic=true)");
        }
        let answer = match params.body_bytes {
            Some(len) => ScenarioAnswer {
                status: params.status,
                headers: vec![
                    ("content-type", "application/octet-stream".to_owned()),
                    ("x-execution", execution.to_string()),
                ],
                body: pattern(len)
                    .chunks(CHUNK_BYTES)
                    .map(Bytes::copy_from_slice)
                    .collect(),
            },
            None => {
                let body = serde_json::json!({
                    "execution": execution,
                    "method": request.method,
                    "path": request.path,
                    "query": request.query,
                    "principal": request.principal,
                    "body": String::from_utf8_lossy(&request.body),
                });
                ScenarioAnswer {
                    status: params.status,
                    headers: vec![
                        ("content-type", "application/json".to_owned()),
                        ("set-cookie", format!("session=s{execution}; Path=/")),
                        ("x-execution", execution.to_string()),
                        ("set-cookie", "theme=dark; Path=/".to_owned()),
                    ],
                    body: vec![Bytes::from(body.to_string())],
                }
            }
        };
        self.state.finished.fetch_add(1, Ordering::SeqCst);
        answer
    }

    /// `GET /executions`: `200` `{"started": N, "finished": M}`.
    pub fn executions(&self) -> ScenarioAnswer {
        let body = serde_json::json!({
            "started": self.state.started.load(Ordering::SeqCst),
            "finished": self.state.finished.load(Ordering::SeqCst),
        });
        ScenarioAnswer {
            status: 200,
            headers: vec![("content-type", "application/json".to_owned())],
            body: vec![Bytes::from(body.to_string())],
        }
    }

    /// `POST /gates/{name}`: opens the gate (it stays open); `204`.
    pub fn open_gate(&self, name: &str) -> ScenarioAnswer {
        self.gate(name).send_replace(true);
        ScenarioAnswer {
            status: 204,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    fn gate(&self, name: &str) -> watch::Sender<bool> {
        let mut gates = self
            .state
            .gates
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        gates
            .entry(name.to_owned())
            .or_insert_with(|| watch::Sender::new(false))
            .clone()
    }
}

/// The body of a `body_bytes=N` answer: `abc…zabc…`, N bytes.
pub fn pattern(len: usize) -> Vec<u8> {
    (b'a'..=b'z').cycle().take(len).collect()
}

/// The handler's query parameters.
#[derive(Debug)]
struct Params<'a> {
    status: u16,
    gate: Option<&'a str>,
    delay_ms: u64,
    panic: bool,
    body_bytes: Option<usize>,
}

impl<'a> Params<'a> {
    fn parse(query: &'a str) -> Self {
        let mut params = Self {
            status: 201,
            gate: None,
            delay_ms: 0,
            panic: false,
            body_bytes: None,
        };
        for pair in query.split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            match name {
                "status" => params.status = value.parse().unwrap_or(params.status),
                "gate" => params.gate = Some(value),
                "delay_ms" => params.delay_ms = value.parse().unwrap_or(0),
                "panic" => params.panic = value == "true",
                "body_bytes" => params.body_bytes = value.parse().ok(),
                _ => {}
            }
        }
        params
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn request(query: &str) -> ScenarioRequest {
        ScenarioRequest {
            method: "POST".into(),
            path: "/required".into(),
            query: query.into(),
            principal: "alice".into(),
            body: Bytes::from_static(b"{\"a\":1}"),
        }
    }

    #[tokio::test]
    async fn the_default_answer_echoes_the_request_with_two_cookies() {
        let app = ScenarioApp::new();
        let answer = app.handle(request("")).await;
        assert_eq!(answer.status, 201);
        assert_eq!(
            answer.headers,
            vec![
                ("content-type", "application/json".to_owned()),
                ("set-cookie", "session=s1; Path=/".to_owned()),
                ("x-execution", "1".to_owned()),
                ("set-cookie", "theme=dark; Path=/".to_owned()),
            ]
        );
        let body: serde_json::Value = serde_json::from_slice(&answer.body[0]).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "execution": 1, "method": "POST", "path": "/required", "query": "",
                "principal": "alice", "body": "{\"a\":1}",
            })
        );
    }

    #[tokio::test]
    async fn body_bytes_streams_the_pattern_in_chunks() {
        let app = ScenarioApp::new();
        let answer = app.handle(request("status=200&body_bytes=40000")).await;
        assert_eq!(answer.status, 200);
        let sizes: Vec<usize> = answer.body.iter().map(Bytes::len).collect();
        assert_eq!(
            sizes,
            vec![CHUNK_BYTES, CHUNK_BYTES, 40000 - 2 * CHUNK_BYTES]
        );
        assert_eq!(answer.body.concat(), pattern(40000));
    }

    #[tokio::test]
    async fn a_gate_holds_the_handler_until_opened() {
        let app = ScenarioApp::new();
        let running = tokio::spawn({
            let app = app.clone();
            async move { app.handle(request("gate=g")).await }
        });
        while app.state.started.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(app.state.finished.load(Ordering::SeqCst), 0);
        assert_eq!(app.open_gate("g").status, 204);
        assert_eq!(running.await.unwrap().status, 201);
        assert_eq!(app.state.finished.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn principal_is_the_bearer_token() {
        assert_eq!(principal(Some(b"Bearer bob")).as_str(), "bob");
        assert_eq!(principal(Some(b"Basic Ym9i")).as_str(), ANONYMOUS);
        assert_eq!(principal(Some(b"Bearer ")).as_str(), ANONYMOUS);
    }
}
