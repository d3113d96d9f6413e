//! A client of one payments example (`docs/contract.md` §8), speaking plain HTTP.
//!
//! The strings of the behaviour specification (header names, problem slugs)
//! are written out here rather than taken from idem-core: this harness checks
//! the specification, not the implementation's idea of it.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The request header that carries the key.
pub(crate) const KEY_HEADER: &str = "idempotency-key";
/// The answer header that marks a replay.
pub(crate) const REPLAYED_HEADER: &str = "idempotent-replayed";
/// The media type of every problem answer (RFC 9457).
const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// A client of one running example.
#[derive(Clone, Debug)]
pub(crate) struct Api {
    http: reqwest::Client,
    base: String,
}

/// One request, as a scenario writes it.
#[derive(Clone, Debug)]
pub(crate) struct Call {
    get: bool,
    path: String,
    principal: Option<String>,
    keys: Vec<Vec<u8>>,
    body: Vec<u8>,
}

/// An answer as the client got it: status, every header in order, the whole body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) body: Vec<u8>,
}

/// `GET /accounts/{id}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Account {
    pub(crate) balance: i64,
    pub(crate) operations: i64,
}

/// How a call that was retried until it had a final answer went.
#[derive(Clone, Debug)]
pub(crate) struct Settled {
    pub(crate) answer: Answer,
    pub(crate) timeouts: u32,
    /// Statuses of the answers that were not final, e.g. `409` or `503`.
    pub(crate) on_the_way: BTreeMap<u16, u32>,
    /// Connection errors (the server restarting, the client cutting off).
    pub(crate) broken: u32,
}

/// A failed check: a short figure for the table, the details for the report.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    pub(crate) figure: String,
    pub(crate) details: String,
}

/// What a check answers: the figure behind a pass, or the failure.
pub(crate) type Outcome = Result<String, Failure>;

impl Api {
    pub(crate) fn new(base: &str) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Self {
            http,
            base: base.to_owned(),
        })
    }

    /// A client of the same server that keeps no connection for another
    /// request: what happens to one request's connection stays with it.
    pub(crate) fn alone(&self) -> Result<Self, Failure> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .build()
            .map_err(|e| Failure::new("no client", format!("cannot build the HTTP client: {e}")))?;
        Ok(Self {
            http,
            base: self.base.clone(),
        })
    }

    /// Sends `call` and reads the whole answer; a transport error is a failure.
    pub(crate) async fn send(&self, call: &Call) -> Result<Answer, Failure> {
        self.send_within(call, None).await?.ok_or_else(|| {
            Failure::new(
                "timed out",
                format!("request: {call}\nexpected: an answer\ngot: a timeout"),
            )
        })
    }

    /// Sends `call`; `Ok(None)` when `timeout` passed first and the client gave up.
    pub(crate) async fn send_within(
        &self,
        call: &Call,
        timeout: Option<Duration>,
    ) -> Result<Option<Answer>, Failure> {
        match self.exchange(call, timeout).await {
            Ok(answer) => Ok(Some(answer)),
            Err(error) if error.is_timeout() => Ok(None),
            Err(error) => Err(Failure::new(
                "no answer",
                format!(
                    "request: {call}\nexpected: an answer\ngot: {}",
                    causes(&error)
                ),
            )),
        }
    }

    /// Retries `call` until a final answer (anything but a timeout, a broken
    /// connection, `409`, `5xx`, `408`, `425`, `429`), within `budget`.
    /// `timeout` picks each attempt's client timeout.
    pub(crate) async fn settle(
        &self,
        call: &Call,
        mut timeout: impl FnMut() -> Option<Duration>,
        budget: Duration,
    ) -> Result<Settled, Failure> {
        let deadline = Instant::now() + budget;
        let mut timeouts = 0;
        let mut broken = 0;
        let mut on_the_way = BTreeMap::new();
        loop {
            let pause = match self.exchange(call, timeout()).await {
                Ok(answer) if !answer.is_retryable() => {
                    return Ok(Settled {
                        answer,
                        timeouts,
                        on_the_way,
                        broken,
                    });
                }
                Ok(answer) => {
                    *on_the_way.entry(answer.status).or_insert(0) += 1;
                    answer.retry_after()
                }
                Err(error) if error.is_timeout() => {
                    timeouts += 1;
                    Duration::from_millis(10)
                }
                Err(_) => {
                    broken += 1;
                    Duration::from_millis(100)
                }
            };
            if Instant::now() + pause > deadline {
                return Err(Failure::new(
                    "never settled",
                    format!(
                        "request: {call}\nexpected: a final answer within {budget:?}\n\
                         got: {timeouts} timeouts, {broken} broken connections, \
                         answers {on_the_way:?}"
                    ),
                ));
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// Reads an account as `principal` sees it.
    pub(crate) async fn account(&self, principal: &str, account: &str) -> Result<Account, Failure> {
        let call = Call::read(principal, account);
        let answer = self.send(&call).await?;
        let parsed: Option<Value> = serde_json::from_slice(&answer.body).ok();
        let field = |name: &str| parsed.as_ref().and_then(|v| v[name].as_i64());
        match (answer.status, field("balance"), field("operations")) {
            (200, Some(balance), Some(operations)) => Ok(Account {
                balance,
                operations,
            }),
            _ => Err(Failure::unexpected(
                &call,
                "200 {\"account_id\", \"balance\", \"operations\"}",
                &answer,
            )),
        }
    }

    async fn exchange(
        &self,
        call: &Call,
        timeout: Option<Duration>,
    ) -> Result<Answer, reqwest::Error> {
        let url = format!("{}{}", self.base, call.path);
        let mut request = if call.get {
            self.http.get(url)
        } else {
            self.http
                .post(url)
                .header("content-type", "application/json")
                .body(call.body.clone())
        };
        if let Some(principal) = &call.principal {
            request = request.bearer_auth(principal);
        }
        for key in &call.keys {
            // reqwest appends: two keys are two header fields.
            request = request.header(KEY_HEADER, key.as_slice());
        }
        if let Some(timeout) = timeout {
            request = request.timeout(timeout);
        }
        Answer::read(request.send().await?).await
    }
}

impl Call {
    /// `POST /accounts/{account}/charges` of `amount` EUR with one key.
    pub(crate) fn charge(principal: &str, account: &str, key: &str, amount: i64) -> Self {
        Self {
            get: false,
            path: format!("/accounts/{account}/charges"),
            principal: Some(principal.to_owned()),
            keys: vec![key.as_bytes().to_vec()],
            body: json!({"amount": amount, "currency": "EUR"})
                .to_string()
                .into_bytes(),
        }
    }

    /// `POST /accounts/{account}/deposits` of `amount` EUR, without a key.
    pub(crate) fn deposit(principal: &str, account: &str, amount: i64) -> Self {
        Self {
            path: format!("/accounts/{account}/deposits"),
            keys: Vec::new(),
            ..Self::charge(principal, account, "", amount)
        }
    }

    /// `GET /accounts/{account}`.
    pub(crate) fn read(principal: &str, account: &str) -> Self {
        Self {
            get: true,
            path: format!("/accounts/{account}"),
            principal: Some(principal.to_owned()),
            keys: Vec::new(),
            body: Vec::new(),
        }
    }

    /// The same call with these key header fields (raw bytes, one field each).
    pub(crate) fn keys(mut self, keys: &[&[u8]]) -> Self {
        self.keys = keys.iter().map(|k| k.to_vec()).collect();
        self
    }

    /// The same call with this body.
    pub(crate) fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }

    /// The same call without `Authorization`.
    pub(crate) fn anonymous(mut self) -> Self {
        self.principal = None;
        self
    }

    /// The same call as another principal.
    pub(crate) fn by(mut self, principal: &str) -> Self {
        self.principal = Some(principal.to_owned());
        self
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", if self.get { "GET" } else { "POST" }, self.path)?;
        match &self.principal {
            Some(p) => write!(f, ", Bearer {p}")?,
            None => write!(f, ", no Authorization")?,
        }
        for key in &self.keys {
            write!(f, ", Idempotency-Key: {}", excerpt(key, 40))?;
        }
        if !self.get {
            write!(f, ", body {}", excerpt(&self.body, 80))?;
        }
        Ok(())
    }
}

impl Answer {
    /// `response` read whole: its status, its header fields in order, its
    /// body.
    pub(crate) async fn read(response: reqwest::Response) -> Result<Self, reqwest::Error> {
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect();
        let body = response.bytes().await?.to_vec();
        Ok(Self {
            status,
            headers,
            body,
        })
    }

    /// The first value of header `name` (lowercase), as text.
    pub(crate) fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    /// Whether the answer carries `Idempotent-Replayed: true`.
    pub(crate) fn replayed(&self) -> bool {
        self.header(REPLAYED_HEADER).as_deref() == Some("true")
    }

    /// The body as JSON, if it is.
    pub(crate) fn json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// Checks an RFC 9457 problem: this status, the problem media type, and
    /// `type`, `title`, `status`, `detail`, with `type` ending in `slug` if given.
    pub(crate) fn problem(&self, status: u16, slug: Option<&str>) -> Result<(), String> {
        if self.status != status {
            return Err(format!("status {}, not {status}", self.status));
        }
        let content_type = self.header("content-type").unwrap_or_default();
        if !content_type.starts_with(PROBLEM_CONTENT_TYPE) {
            return Err(format!(
                "content-type {content_type:?}, not {PROBLEM_CONTENT_TYPE}"
            ));
        }
        let body = self.json().ok_or("a body that is not JSON")?;
        let kind = body["type"].as_str().ok_or("no `type`")?;
        if let Some(slug) = slug
            && !kind.ends_with(slug)
        {
            return Err(format!("type {kind:?} does not end in {slug:?}"));
        }
        if body["status"].as_u64() != Some(u64::from(status)) {
            return Err(format!("`status` {} in the body", body["status"]));
        }
        for field in ["title", "detail"] {
            if !body[field].is_string() {
                return Err(format!("no `{field}`"));
            }
        }
        Ok(())
    }

    /// Checks that `self` replays `original`: `Idempotent-Replayed: true`, the
    /// same status, every other header, the body byte for byte.
    pub(crate) fn replays(&self, original: &Answer) -> Result<(), String> {
        if !self.replayed() {
            return Err(format!("no `{REPLAYED_HEADER}: true`"));
        }
        if self.status != original.status {
            return Err(format!("status {}, not {}", self.status, original.status));
        }
        if self.body != original.body {
            return Err(format!(
                "body {} differs from the original {}",
                excerpt(&self.body, 200),
                excerpt(&original.body, 200)
            ));
        }
        let (mine, theirs) = (self.stored_headers(), original.stored_headers());
        if mine != theirs {
            return Err(format!(
                "headers {:?} differ from the original {:?}",
                printable(&mine),
                printable(&theirs)
            ));
        }
        Ok(())
    }

    /// How long the server asked to wait: `Retry-After` seconds, capped at 1 s
    /// to keep runs short; 200 ms when it did not say.
    fn retry_after(&self) -> Duration {
        self.header("retry-after")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(Duration::from_millis(200), |secs| {
                Duration::from_secs(secs).min(Duration::from_secs(1))
            })
    }

    fn is_retryable(&self) -> bool {
        matches!(self.status, 409 | 408 | 425 | 429) || self.status >= 500
    }

    /// Headers that a replay must repeat, sorted by name only so that repeated
    /// fields keep their order.
    fn stored_headers(&self) -> Vec<(String, Vec<u8>)> {
        let mut headers: Vec<_> = self
            .headers
            .iter()
            .filter(|(name, _)| name != REPLAYED_HEADER && !idem_testkit::is_framing_header(name))
            .cloned()
            .collect();
        headers.sort_by(|a, b| a.0.cmp(&b.0));
        headers
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.status)?;
        for (name, value) in &self.headers {
            if name != "date" {
                write!(f, ", {name}: {}", excerpt(value, 60))?;
            }
        }
        write!(f, ", body {}", excerpt(&self.body, 300))
    }
}

impl Failure {
    pub(crate) fn new(figure: impl Into<String>, details: impl Into<String>) -> Self {
        Self {
            figure: figure.into(),
            details: details.into(),
        }
    }

    /// The answer to `call` was not `expected`.
    pub(crate) fn unexpected(call: &Call, expected: impl fmt::Display, got: &Answer) -> Self {
        Self::new(
            format!("got {}", got.status),
            format!("request: {call}\nexpected: {expected}\ngot: {got}"),
        )
    }

    /// The details, headed by what was being tried.
    pub(crate) fn details_of(self, what: &str) -> String {
        format!("[{what}]\n{}", self.details)
    }

    /// The answer to `call` was wrong in the way `why` says.
    pub(crate) fn wrong(call: &Call, expected: impl fmt::Display, got: &Answer, why: &str) -> Self {
        Self::new(
            format!("got {}: {}", got.status, excerpt(why.as_bytes(), 60)),
            format!("request: {call}\nexpected: {expected}\ngot: {got}\nwrong: {why}"),
        )
    }
}

/// An account that saw `operations` charges and deposits adding up to `balance`.
pub(crate) fn effects(operations: i64, balance: i64) -> Account {
    Account {
        balance,
        operations,
    }
}

/// Checks that `account`, as `principal` sees it, holds exactly this much.
pub(crate) async fn expect_account(
    api: &Api,
    principal: &str,
    account: &str,
    want: Account,
    after: &str,
) -> Result<(), Failure> {
    let got = api.account(principal, account).await?;
    if got == want {
        Ok(())
    } else {
        Err(Failure::new(
            format!("{} operations, not {}", got.operations, want.operations),
            format!(
                "after: {after}\nrequest: GET /accounts/{account}, Bearer {principal}\n\
                 expected: balance {}, {} operations\ngot: balance {}, {} operations",
                want.balance, want.operations, got.balance, got.operations
            ),
        ))
    }
}

/// At most `max` characters of `bytes`, escaped where not printable.
pub(crate) fn excerpt(bytes: &[u8], max: usize) -> String {
    let text = bytes.escape_ascii().to_string();
    if text.len() <= max {
        format!("'{text}'")
    } else {
        let cut: String = text.chars().take(max).collect();
        format!("'{cut}…' ({} bytes)", bytes.len())
    }
}

/// An error with its causes: reqwest's own message names only the request.
fn causes(error: &dyn std::error::Error) -> String {
    idem_core::log::error_chain(error)
}

fn printable(headers: &[(String, Vec<u8>)]) -> Vec<String> {
    headers
        .iter()
        .map(|(n, v)| format!("{n}: {}", v.escape_ascii()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&str, &str)], body: &str) -> Answer {
        Answer {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
                .collect(),
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_replay_may_differ_only_in_framing_headers() {
        let original = answer(
            201,
            &[
                ("date", "a"),
                ("x-a", "1"),
                ("x-a", "2"),
                ("content-length", "2"),
            ],
            "{}",
        );
        let replay = answer(
            201,
            &[
                ("x-a", "1"),
                ("idempotent-replayed", "true"),
                ("date", "b"),
                ("x-a", "2"),
            ],
            "{}",
        );
        assert_eq!(replay.replays(&original), Ok(()));
        let reordered = answer(
            201,
            &[("x-a", "2"), ("x-a", "1"), ("idempotent-replayed", "true")],
            "{}",
        );
        assert!(reordered.replays(&original).is_err());
        let unmarked = answer(201, &[("x-a", "1"), ("x-a", "2")], "{}");
        assert!(unmarked.replays(&original).is_err());
    }

    #[test]
    fn a_problem_has_its_media_type_fields_and_slug() {
        let body = r#"{"type":"https://idem.rs/problems/key-reused","title":"t","status":422,"detail":"d"}"#;
        let problem = answer(422, &[("content-type", "application/problem+json")], body);
        assert_eq!(problem.problem(422, Some("key-reused")), Ok(()));
        assert!(problem.problem(422, Some("invalid-key")).is_err());
        let plain = answer(422, &[("content-type", "application/json")], body);
        assert!(plain.problem(422, None).is_err());
    }
}
