//! The middleware against a real axum server keeping keys in idem's
//! layer, through a fault-injecting proxy where an answer must be lost.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use idem_axum::IdempotencyLayer;
use idem_axum::idem_core::retry::{Backoff, Jitter, RetryPolicy};
use idem_axum::idem_core::{MemoryStore, Policy};
use idem_client::{IdempotentRetry, IdempotentRetryLayer, attempts, attempts_of, replayed};
use idem_testkit::fault::{Fault, Proxy};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use tower::{Layer, ServiceExt};

/// What the server saw.
#[derive(Default)]
struct Seen {
    /// Charges begun (the handler behind the layer was entered).
    begun: AtomicU32,
    /// Charges applied.
    effects: AtomicU32,
    /// Requests to `/unavailable`, by the key they carried.
    unavailable: Mutex<HashMap<String, u32>>,
}

async fn server() -> (SocketAddr, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let store = MemoryStore::new();
    let charges = {
        let seen = seen.clone();
        move |body: String| async move {
            seen.begun.fetch_add(1, Ordering::SeqCst);
            // Long enough for a second request to find the first in progress.
            if body.contains("slow") {
                tokio::time::sleep(Duration::from_millis(600)).await;
            }
            let effect = seen.effects.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("charge {effect}"))
        }
    };
    let unavailable = {
        let seen = seen.clone();
        move |headers: HeaderMap| async move {
            let key = headers
                .get("idempotency-key")
                .and_then(|value| value.to_str().ok())
                .unwrap_or("none")
                .to_owned();
            *seen.unavailable.lock().unwrap().entry(key).or_default() += 1;
            let retry_after = headers.contains_key("x-ask-retry-after");
            match retry_after {
                true => (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "1")]).into_response(),
                false => StatusCode::SERVICE_UNAVAILABLE.into_response(),
            }
        }
    };
    let app = Router::new()
        .route(
            "/charges",
            post(charges).route_layer(
                IdempotencyLayer::new(store, Policy::required().lease(Duration::from_secs(5)))
                    .global_scope(),
            ),
        )
        .route("/unavailable", post(unavailable))
        .route(
            "/hang",
            post(|| async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                StatusCode::CREATED
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, seen)
}

/// Retries at fixed delays (no jitter), so a test knows when each comes.
fn fixed(base_ms: u64) -> RetryPolicy {
    let base = Duration::from_millis(base_ms);
    RetryPolicy::default().backoff(Backoff::new(base, base).jitter(Jitter::None))
}

fn client(retry: IdempotentRetry) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(retry)
        .build()
}

/// What a client saw of its charge: status, replayed, attempts, body.
type Saw = (StatusCode, bool, Option<u32>, String);

/// A charge through a proxy that loses the server's first answer: `send`
/// posts `amount=100` to the URL it is given and reports what it saw.
async fn lose_the_first_answer<F, S>(send: S)
where
    S: FnOnce(String) -> F,
    F: Future<Output = Saw> + Send + 'static,
{
    let (addr, seen) = server().await;
    let proxy = Proxy::tcp(addr).unwrap();
    proxy.set(Fault::LoseAnswers);
    let sending = tokio::spawn(send(format!("http://{}/charges", proxy.addr())));
    // The server applies the charge; its answer is lost (the proxy has
    // closed the connection on it, not merely seen the charge: the answer
    // could still be on its way); the retry, 300 ms later, passes.
    while proxy.lost_answers() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.set(Fault::None);
    let (status, replayed, sent, body) = sending.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert!(replayed, "the retry is answered from the record");
    assert_eq!(sent, Some(2));
    assert_eq!(body, "charge 1");
    assert_eq!(seen.effects.load(Ordering::SeqCst), 1, "one charge");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_retried_with_the_same_key_and_replayed() {
    lose_the_first_answer(|url| async move {
        let client = client(IdempotentRetry::new().policy(fixed(300)));
        let answer = client.post(url).body("amount=100").send().await.unwrap();
        assert!(attempts(&answer).and_then(|a| a.key.clone()).is_some());
        let (status, replayed) = (answer.status(), replayed(&answer));
        let sent = attempts(&answer).map(|a| a.sent);
        (status, replayed, sent, answer.text().await.unwrap())
    })
    .await;
}

/// The same through the Tower layer, around a service that sends each
/// request with reqwest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tower_layer_retries_a_lost_answer_with_the_same_key() {
    lose_the_first_answer(|url| async move {
        let http = reqwest::Client::new();
        let transport = tower::service_fn(move |request: http::Request<String>| {
            let http = http.clone();
            async move {
                let answer = http.execute(reqwest::Request::try_from(request)?).await?;
                let mut response = http::Response::new(String::new());
                *response.status_mut() = answer.status();
                *response.headers_mut() = answer.headers().clone();
                *response.body_mut() = answer.text().await?;
                Ok::<_, reqwest::Error>(response)
            }
        });
        let client =
            IdempotentRetryLayer::new(IdempotentRetry::new().policy(fixed(300))).layer(transport);
        let request = http::Request::post(url)
            .body("amount=100".to_owned())
            .unwrap();
        let answer = client.oneshot(request).await.unwrap();
        let sent = attempts_of(answer.extensions()).map(|a| a.sent);
        let replayed = answer.headers().get("idempotent-replayed").is_some();
        (answer.status(), replayed, sent, answer.into_body())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_is_waited_out_and_the_first_answer_replayed() {
    let (addr, seen) = server().await;
    let url = format!("http://{addr}/charges");
    let key = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let first = {
        let url = url.clone();
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .header("idempotency-key", key)
                .body("slow")
                .send()
                .await
        })
    };
    // In the handler: the layer has claimed the key.
    while seen.begun.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let answer = client(IdempotentRetry::new().policy(fixed(200)))
        .post(&url)
        .header("idempotency-key", key)
        .body("slow")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::CREATED);
    assert!(replayed(&answer));
    // A 409 with `Retry-After: 1` (the layer's in-progress answer), then,
    // 1.2 s later, the first done by then, its replay.
    assert_eq!(attempts(&answer).map(|a| a.sent), Some(2));
    assert_eq!(answer.text().await.unwrap(), "charge 1");
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
    assert_eq!(seen.effects.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_another_body_is_not_retried() {
    let (addr, seen) = server().await;
    let client = client(IdempotentRetry::new().policy(fixed(10)));
    let url = format!("http://{addr}/charges");
    let key = "5b0e1c7a-0d7e-4c55-9d0f-1f2a3b4c5d6e";
    let charge = |body: &'static str| {
        let request = client.post(&url).header("idempotency-key", key).body(body);
        async move { request.send().await.unwrap() }
    };
    assert_eq!(charge("amount=1").await.status(), StatusCode::CREATED);
    let reused = charge("amount=2").await;
    assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(attempts(&reused).map(|a| a.sent), Some(1));
    assert_eq!(seen.effects.load(Ordering::SeqCst), 1);
}

/// 50 requests at once against a server that answers 503 to all: without a
/// budget each is sent 4 times; with one, the retries stay within a fifth of
/// the first attempts. Every attempt of a request carries its
/// one key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_stops_a_storm() {
    async fn storm(retry: IdempotentRetry) -> HashMap<String, u32> {
        let (addr, seen) = server().await;
        let client = client(retry.policy(fixed(20)));
        let url = format!("http://{addr}/unavailable");
        let sends = (0..50).map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move { client.post(url).body("x").send().await })
        });
        for send in sends {
            let answer = send.await.unwrap().unwrap();
            assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        }
        seen.unavailable.lock().unwrap().clone()
    }
    let unbudgeted = storm(IdempotentRetry::new().without_budget()).await;
    assert_eq!(unbudgeted.len(), 50, "a key per request");
    assert!(unbudgeted.values().all(|&sent| sent == 4), "{unbudgeted:?}");
    // 20 % of 50 first attempts, no floor, over a window the storm ends
    // well within however slow the machine (so no deposit expires in it).
    let budgeted = storm(IdempotentRetry::new().budget(Duration::from_secs(10), 0, 0.2)).await;
    assert_eq!(budgeted.len(), 50, "a key per request");
    let sent: u32 = budgeted.values().sum();
    // Some retries passed (the budget is not a ban), at most 10 of them.
    assert!((51..=60).contains(&sent), "{sent} requests: {budgeted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured_within_the_deadline() {
    let (addr, seen) = server().await;
    let client = client(
        IdempotentRetry::new()
            .policy(fixed(200))
            .deadline(Duration::from_secs(2)),
    );
    let started = std::time::Instant::now();
    let answer = client
        .post(format!("http://{addr}/unavailable"))
        .header("x-ask-retry-after", "1")
        .body("x")
        .send()
        .await
        .unwrap();
    // At 0 s, then after the asked 1 s and the backoff's 200 ms; a third
    // would start past 2 s (1.2 + 1 + 0.2).
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(attempts(&answer).map(|a| a.sent), Some(2));
    assert!(started.elapsed() >= Duration::from_millis(1_200));
    let hits = seen.unavailable.lock().unwrap().clone();
    assert_eq!(hits.values().copied().collect::<Vec<_>>(), vec![2]);
}

/// An attempt still unanswered at the deadline ends there, as reqwest's
/// timeout: no retry starts past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_ends_at_the_deadline() {
    let (addr, _seen) = server().await;
    let client = client(IdempotentRetry::new().deadline(Duration::from_millis(300)));
    let failed = client
        .post(format!("http://{addr}/hang"))
        .body("x")
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(&failed, reqwest_middleware::Error::Reqwest(e) if e.is_timeout()),
        "{failed:?}"
    );
}

/// With `metrics`, the storm's attempts, retries and refusals are counted:
/// read back from a recorder installed on this test's one thread.
#[cfg(feature = "metrics")]
#[test]
fn attempts_retries_and_refusals_are_counted() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let hits: HashMap<String, u32> = metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let (addr, seen) = server().await;
            let retry =
                IdempotentRetry::new()
                    .policy(fixed(20))
                    .budget(Duration::from_secs(1), 1, 0.2);
            let client = client(retry);
            let url = format!("http://{addr}/unavailable");
            let sends = (0..20).map(|_| {
                let (client, url) = (client.clone(), url.clone());
                tokio::spawn(async move { client.post(url).body("x").send().await })
            });
            for send in sends {
                send.await.unwrap().unwrap();
            }
            seen.unavailable.lock().unwrap().clone()
        })
    });
    let sent: u32 = hits.values().sum();
    // The policy retries a 503 three times: a request sent fewer times was
    // refused a retry by the budget.
    let refused = hits.values().filter(|&&sent| sent < 4).count() as u64;
    assert!(refused > 0, "the budget refused some: {hits:?}");
    let counters: HashMap<String, u64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, .., value)| {
            let labels: Vec<String> = key.key().labels().map(|l| l.value().to_owned()).collect();
            let name = [vec![key.key().name().to_owned()], labels]
                .concat()
                .join(".");
            match value {
                DebugValue::Counter(n) => (name, n),
                other => panic!("{name}: not a counter: {other:?}"),
            }
        })
        .collect();
    let count = |name: &str| counters.get(name).copied().unwrap_or(0);
    assert_eq!(count("idem_client_attempts_total"), u64::from(sent));
    assert_eq!(count("idem_client_retries_total"), u64::from(sent) - 20);
    assert_eq!(
        count("idem_client_retries_refused_total.budget"),
        refused,
        "{counters:?}"
    );
}
