//! What the client gets: first answers, replays, stored and released statuses,
//! body limits (`docs/contract.md` §4 and §5).

use bytes::Bytes;
use serde_json::json;

use crate::Target;
use crate::app::{LIMITED_BYTES, pattern};
use crate::client::{Call, Client, Executions, assert_executed, assert_problem, assert_replay_of};

pub(crate) async fn first_request_runs_the_handler(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/required", "first-1", r#"{"amount":5}"#).principal("alice");
    let first = client.send(&call).await;
    assert_executed(&first, 201);
    assert_eq!(first.header("content-type"), "application/json");
    assert_eq!(first.execution(), 1);
    assert_eq!(
        first.json(),
        json!({
            "execution": 1, "method": "POST", "path": "/required", "query": "",
            "principal": "alice", "body": r#"{"amount":5}"#,
        })
    );
    assert_eq!(
        client.executions().await,
        Executions {
            started: 1,
            finished: 1
        }
    );
}

pub(crate) async fn replay_is_byte_identical(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/required?status=200", "replay-1", r#"{"amount":5}"#);
    let first = client.send(&call).await;
    assert_executed(&first, 200);
    let second = client.send(&call).await;
    assert_replay_of(&second, &first);
    let third = client.send(&call).await;
    assert_replay_of(&third, &first);
    assert_eq!(client.executions().await.started, 1);
}

pub(crate) async fn repeated_set_cookie_headers_replay_intact(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/required", "cookies-1", "{}");
    let first = client.send(&call).await;
    let cookies: Vec<&[u8]> = vec![b"session=s1; Path=/", b"theme=dark; Path=/"];
    assert_eq!(first.values("set-cookie"), cookies);
    let replay = client.send(&call).await;
    assert_replay_of(&replay, &first);
    assert_eq!(replay.values("set-cookie"), cookies);
}

pub(crate) async fn different_request_with_the_same_key_is_key_reused(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/required", "reused-1", r#"{"amount":5}"#);
    let first = client.send(&call).await;
    assert_executed(&first, 201);
    for (what, other) in [
        (
            "body",
            Call::post("/required", "reused-1", r#"{"amount":6}"#),
        ),
        (
            "query",
            Call::post("/required?status=200", "reused-1", r#"{"amount":5}"#),
        ),
        (
            "method",
            Call::new("PATCH", "/required")
                .key("reused-1")
                .body(r#"{"amount":5}"#),
        ),
    ] {
        let answer = client.send(&other).await;
        let problem = assert_problem(&answer, 422, "key-reused");
        assert!(!answer.is_replay(), "a different {what} is not a replay");
        assert_eq!(problem["status"], 422, "different {what}");
    }
    // The record is untouched: the original request still replays.
    assert_replay_of(&client.send(&call).await, &first);
    assert_eq!(client.executions().await.started, 1);
}

pub(crate) async fn stored_statuses_replay(target: Target) {
    let client = Client::new(&target);
    let statuses = [200, 202, 204, 400, 404, 409, 422];
    for status in statuses {
        let call = Call::post(
            &format!("/required?status={status}"),
            &format!("stored-{status}"),
            "{}",
        );
        let first = client.send(&call).await;
        assert_executed(&first, status);
        assert_replay_of(&client.send(&call).await, &first);
    }
    assert_eq!(client.executions().await.started, statuses.len() as u64);
}

pub(crate) async fn released_statuses_run_again(target: Target) {
    let client = Client::new(&target);
    let statuses = [500, 503, 408, 425, 429];
    for status in statuses {
        let call = Call::post(
            &format!("/required?status={status}"),
            &format!("released-{status}"),
            "{}",
        );
        let first = client.send(&call).await;
        assert_executed(&first, status);
        let retry = client.send(&call).await;
        assert_executed(&retry, status);
        assert_eq!(
            retry.execution(),
            first.execution() + 1,
            "the retry of a {status} runs the handler again"
        );
    }
    assert_eq!(client.executions().await.started, 2 * statuses.len() as u64);
}

pub(crate) async fn panicking_handler_is_a_500_problem_and_runs_again(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/required?panic=true", "panic-1", "{}");
    for attempt in 1..=2 {
        let answer = client.send(&call).await;
        assert_problem(&answer, 500, "handler-failed");
        assert_eq!(
            client.executions().await,
            Executions {
                started: attempt,
                finished: 0
            },
            "attempt {attempt} ran the handler"
        );
    }
    // The app is unharmed.
    let fine = client.send(&Call::post("/required", "panic-2", "{}")).await;
    assert_executed(&fine, 201);
}

pub(crate) async fn request_body_over_the_limit_is_rejected(target: Target) {
    let client = Client::new(&target);
    let over = Bytes::from(pattern(LIMITED_BYTES + 1));
    let whole = client
        .send(&Call::post("/limited", "large-1", "").body(over.clone()))
        .await;
    assert_problem(&whole, 413, "payload-too-large");
    let chunked = client
        .send(&Call::post("/limited", "large-2", "").chunked(vec![
            over.slice(..500),
            over.slice(500..1000),
            over.slice(1000..),
        ]))
        .await;
    assert_problem(&chunked, 413, "payload-too-large");
    assert_eq!(client.executions().await.started, 0);

    // At the limit, the handler gets every byte.
    let at_limit = Bytes::from(pattern(LIMITED_BYTES));
    let answer = client
        .send(&Call::post("/limited", "large-3", "").body(at_limit.clone()))
        .await;
    assert_executed(&answer, 201);
    assert_eq!(
        answer.json()["body"],
        json!(String::from_utf8_lossy(&at_limit))
    );
    assert_eq!(client.executions().await.started, 1);
}

pub(crate) async fn streamed_request_body_is_forwarded_intact(target: Target) {
    let client = Client::new(&target);
    let body = r#"{"amount":5,"currency":"EUR"}"#;
    let chunks = vec![
        Bytes::from_static(br#"{"amount":"#),
        Bytes::from_static(br#"5,"currency""#),
        Bytes::from_static(br#":"EUR"}"#),
    ];
    let first = client
        .send(&Call::post("/required", "stream-1", "").chunked(chunks))
        .await;
    assert_executed(&first, 201);
    assert_eq!(first.json()["body"], json!(body));
    // The fingerprint covers the bytes, not how they were chunked.
    let whole = client
        .send(&Call::post("/required", "stream-1", body))
        .await;
    assert_replay_of(&whole, &first);
    assert_eq!(client.executions().await.started, 1);
}

pub(crate) async fn response_over_the_stored_body_limit_is_sent_but_not_replayed(target: Target) {
    let client = Client::new(&target);
    let large = 100_000;
    let call = Call::post(
        &format!("/limited?status=200&body_bytes={large}"),
        "big-answer-1",
        "",
    );
    let first = client.send(&call).await;
    assert_executed(&first, 200);
    assert_eq!(first.body.len(), large);
    assert!(first.body == pattern(large), "the streamed body is intact");
    let retry = client.send(&call).await;
    assert_problem(&retry, 410, "response-not-stored");
    assert_eq!(client.executions().await.started, 1);

    // One byte over the limit is not kept; at the limit it is.
    let over = Call::post(
        &format!("/limited?status=200&body_bytes={}", LIMITED_BYTES + 1),
        "big-answer-2",
        "",
    );
    let first = client.send(&over).await;
    assert_eq!(first.body.len(), LIMITED_BYTES + 1);
    assert_problem(&client.send(&over).await, 410, "response-not-stored");
    let at = Call::post(
        &format!("/limited?status=200&body_bytes={LIMITED_BYTES}"),
        "big-answer-3",
        "",
    );
    let first = client.send(&at).await;
    assert_eq!(first.body, pattern(LIMITED_BYTES));
    assert_replay_of(&client.send(&at).await, &first);
    assert_eq!(client.executions().await.started, 3);
}

/// A declared body far over the limit is refused with `413`, and the client
/// reads that answer rather than a reset connection: the refused body is read
/// and dropped (within bounds) before the answer.
pub(crate) async fn oversized_body_is_answered_413_not_reset(target: Target) {
    let client = Client::new(&target);
    let over = Bytes::from(pattern(4 * 1024 * 1024));
    for attempt in 0..3 {
        let key = format!("oversized-{attempt}");
        let answer = client
            .send(&Call::post("/limited", &key, "").body(over.clone()))
            .await;
        assert_problem(&answer, 413, "payload-too-large");
    }
    assert_eq!(client.executions().await.started, 0);
}

/// A chunked body that breaks off mid-way (a malformed chunk) is answered
/// `400 body-unreadable`; nothing is claimed or run.
pub(crate) async fn broken_request_body_is_400_body_unreadable(target: Target) {
    let answer = raw_answer(
        &target,
        "/required",
        "broken-1",
        "5\r\n{\"a\":\r\nzz\r\n",
        Until::Holds("body-unreadable"),
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 400"),
        "a broken body must be answered 400, got: {answer}"
    );
    assert!(
        answer.contains("https://idem.rs/problems/body-unreadable"),
        "the problem names the broken body: {answer}"
    );
    assert_eq!(client_executions(&target).await, 0);
    // The key was never claimed: a whole request with it runs.
    let whole = Client::new(&target)
        .send(&Call::post("/required", "broken-1", "{\"a\":1}"))
        .await;
    assert_executed(&whole, 201);
}

/// A chunked body that sends its first chunk and then nothing (a client that
/// stopped, a slowloris) is answered `408 body-timeout` once the route's read
/// deadline passes (500 ms on `/quick-body`): nothing ran, nothing was claimed.
/// Then the connection closes, rather than waiting on for the rest of the body
/// (actix-web waited for it without end before idem-actix closed it).
pub(crate) async fn stalled_request_body_is_408_body_timeout(target: Target) {
    let answer = raw_answer(
        &target,
        "/quick-body",
        "stalled-1",
        "5\r\n{\"a\":\r\n",
        Until::Closed,
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "a stalled body must be answered 408, got: {answer}"
    );
    assert!(
        answer.contains("https://idem.rs/problems/body-timeout"),
        "the problem names the timeout: {answer}"
    );
    assert_eq!(client_executions(&target).await, 0);
    let whole = Client::new(&target)
        .send(&Call::post("/quick-body", "stalled-1", "{\"a\":1}"))
        .await;
    assert_executed(&whole, 201);
}

/// How long [`raw_answer`] reads.
enum Until {
    /// Until the answer holds this text.
    Holds(&'static str),
    /// Until the server closes the connection.
    Closed,
}

/// Sends a keyed chunked POST to `path` whose body is `chunks` as written
/// (then nothing more), and answers what the server sent back, read as far as
/// `until` says; reading longer than 10 s is a failure.
async fn raw_answer(target: &Target, path: &str, key: &str, chunks: &str, until: Until) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let base = target.base().trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&base)
        .await
        .unwrap_or_else(|error| panic!("cannot connect to {base}: {error}"));
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {base}\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{chunks}"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .unwrap_or_else(|error| panic!("cannot send the request: {error}"));
    let mut answer = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        let mut buffer = [0u8; 4096];
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    answer.extend_from_slice(&buffer[..n]);
                    if let Until::Holds(text) = until
                        && String::from_utf8_lossy(&answer).contains(text)
                    {
                        break;
                    }
                }
            }
        }
    })
    .await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    match until {
        Until::Holds(text) => assert!(
            read.is_ok(),
            "no answer holding {text} within 10 s: {answer}"
        ),
        Until::Closed => assert!(
            read.is_ok(),
            "the connection was still open 10 s after: {answer}"
        ),
    }
    answer
}

async fn client_executions(target: &Target) -> u64 {
    Client::new(target).executions().await.started
}

/// With the store down, a fail-open route runs its handler unguarded; a handler
/// that panics there is answered `500 handler-failed` as a guarded one is, and
/// the app is unharmed.
pub(crate) async fn unguarded_panicking_handler_is_a_500_problem(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/fail-open?panic=true", "open-panic-1", "{}");
    for attempt in 1..=2 {
        let answer = client.send(&call).await;
        assert_problem(&answer, 500, "handler-failed");
        assert_eq!(client.executions().await.started, attempt);
    }
    let fine = client
        .send(&Call::post("/fail-open", "open-panic-2", "{}"))
        .await;
    assert_executed(&fine, 201);
}
