//! The protocol driven as an adapter drives it, without one: a request is a
//! method, a key and a body; the handler counts its runs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{self, Iter};

use super::*;
use crate::{HeaderSource, MemoryStore, Policy, REPLAYED_HEADER};

/// A request body: its chunks, each a success or a failure.
type Chunks = Iter<std::vec::IntoIter<Result<Bytes, String>>>;
/// A handler's body stream (the tests answer with complete bodies or these).
type Body = Iter<std::vec::IntoIter<Result<Bytes, String>>>;
type Answer = Outcome<&'static str, Chunks, u16, Body, &'static str>;

/// The header fields of a test request: at most its key.
struct Headers(Option<&'static str>);

impl HeaderSource for Headers {
    fn each_field<'a>(&'a self, name: &str, each: &mut dyn FnMut(&'a [u8])) {
        if let (Some(key), true) = (self.0, name.eq_ignore_ascii_case(KEY_HEADER)) {
            each(key.as_bytes());
        }
    }
}

fn start(engine: &Engine, method: &str, key: Option<&'static str>) -> Start {
    let headers = Headers(key);
    let head = RequestHead {
        method,
        path: "/charges",
        query: "",
        headers: &headers,
    };
    engine.start(&head, &ScopeSource::global(), &())
}

fn keyed(engine: &Engine, key: &'static str) -> Keyed {
    match start(engine, "POST", Some(key)) {
        Start::Keyed(keyed) => keyed,
        other => panic!("expected a keyed request, got {other:?}"),
    }
}

fn chunks(parts: &[&'static str]) -> Chunks {
    stream::iter(
        parts
            .iter()
            .map(|part| Ok(Bytes::from_static(part.as_bytes())))
            .collect::<Vec<_>>(),
    )
}

/// A handler that counts its runs and answers `201` with the body it read.
fn charge(
    runs: &Arc<AtomicU32>,
) -> impl FnOnce(
    &'static str,
    Bytes,
    ExecutionInfo,
) -> std::future::Ready<Result<Handled<u16, Body>, &'static str>>
+ Send
+ 'static {
    let runs = Arc::clone(runs);
    move |kept, body, info| {
        assert_eq!(kept, "kept");
        assert!(info.is_guarded());
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Handled {
            head: 201,
            status: 201,
            headers: vec![Header::new("content-type", "text/plain")],
            body: HandlerBody::Complete(body),
        }))
    }
}

async fn send(
    engine: &Engine,
    key: &'static str,
    body: &[&'static str],
    runs: &Arc<AtomicU32>,
) -> Answer {
    keyed(engine, key)
        .respond("kept", None, chunks(body), charge(runs))
        .await
}

fn answer(outcome: Answer) -> (StoredResponse, Remnant<&'static str, Chunks, u16>) {
    match outcome {
        Outcome::Answer { answer, remnant } => (answer, remnant),
        Outcome::Deliver { head, .. } => panic!("delivered {head}, expected an answer"),
        Outcome::Failed(error) => panic!("failed with {error}, expected an answer"),
    }
}

fn problem_type(answer: &StoredResponse) -> String {
    let body: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    body["type"]
        .as_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_owned()
}

#[test]
fn start_passes_through_refuses_or_goes_on() {
    let engine = Engine::new(MemoryStore::new(), Policy::required());
    assert!(matches!(
        start(&engine, "GET", Some("k")),
        Start::PassThrough
    ));
    assert!(matches!(start(&engine, "POST", Some("k")), Start::Keyed(_)));
    match start(&engine, "POST", None) {
        Start::Answer(answer) => {
            assert_eq!(answer.status, 400);
            assert_eq!(problem_type(&answer), "missing-key");
        }
        other => panic!("{other:?}"),
    }
    let optional = Engine::new(MemoryStore::new(), Policy::optional());
    assert!(matches!(start(&optional, "POST", None), Start::PassThrough));
}

#[test]
fn start_refuses_two_keys_and_a_missing_scope() {
    let engine = Engine::new(MemoryStore::new(), Policy::required());
    struct Two;
    impl HeaderSource for Two {
        fn each_field<'a>(&'a self, _: &str, each: &mut dyn FnMut(&'a [u8])) {
            each(b"a");
            each(b"b");
        }
    }
    let head = RequestHead {
        method: "PATCH",
        path: "/",
        query: "",
        headers: &Two,
    };
    match engine.start(&head, &ScopeSource::global(), &()) {
        Start::Answer(answer) => assert_eq!(problem_type(&answer), "invalid-key"),
        other => panic!("{other:?}"),
    }
    let nobody = ScopeSource::resolve_with("a principal", |_: &()| None);
    let head = RequestHead {
        method: "POST",
        path: "/",
        query: "",
        headers: &Headers(Some("k")),
    };
    match engine.start(&head, &nobody, &()) {
        Start::Answer(answer) => {
            assert_eq!(answer.status, 500);
            assert_eq!(problem_type(&answer), "scope-unavailable");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn the_handler_runs_once_and_the_retry_replays_with_the_request_back() {
    let engine = Engine::new(MemoryStore::new(), Policy::required());
    let runs = Arc::new(AtomicU32::new(0));
    match send(&engine, "k", &["{\"amount\":", "5}"], &runs).await {
        Outcome::Deliver {
            head,
            body: Delivered::Complete(body),
        } => {
            assert_eq!(head, 201);
            assert_eq!(&body[..], b"{\"amount\":5}");
        }
        other => panic!("{other:?}"),
    }
    let (replay, remnant) = answer(send(&engine, "k", &["{\"amount\":5}"], &runs).await);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(replay.status, 201);
    assert_eq!(&replay.body[..], b"{\"amount\":5}");
    assert_eq!(
        replay.header_values(REPLAYED_HEADER).next(),
        Some(&b"true"[..])
    );
    let Remnant::Request { kept, body } = remnant else {
        panic!("the handler did not run: the request comes back");
    };
    assert_eq!(kept, "kept");
    assert_eq!(
        futures_util::StreamExt::count(body).await,
        0,
        "read to its end"
    );
}

#[tokio::test]
async fn another_body_under_the_key_is_refused() {
    let engine = Engine::new(MemoryStore::new(), Policy::required());
    let runs = Arc::new(AtomicU32::new(0));
    let _ = send(&engine, "k", &["one"], &runs).await;
    let (refused, _) = answer(send(&engine, "k", &["two"], &runs).await);
    assert_eq!(
        (refused.status, problem_type(&refused).as_str()),
        (422, "key-reused")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused_unclaimed_and_handed_back() {
    let engine = Engine::new(MemoryStore::new(), Policy::required().request_body_limit(4));
    let runs = Arc::new(AtomicU32::new(0));
    // Declared over the limit: refused before a byte is read.
    let (refused, remnant) = answer(
        keyed(&engine, "k")
            .respond("kept", Some(5), chunks(&["12345"]), charge(&runs))
            .await,
    );
    assert_eq!(
        (refused.status, problem_type(&refused).as_str()),
        (413, "payload-too-large")
    );
    assert!(matches!(remnant, Remnant::Request { kept: "kept", .. }));
    // Undeclared, found over the limit while read.
    let (refused, _) = answer(send(&engine, "k", &["12", "345"], &runs).await);
    assert_eq!(refused.status, 413);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Nothing was claimed: a body within the limit runs.
    assert!(matches!(
        send(&engine, "k", &["1234"], &runs).await,
        Outcome::Deliver { .. }
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_that_fails_or_stalls_is_refused_unclaimed() {
    let engine = Engine::new(
        MemoryStore::new(),
        Policy::required().request_body_timeout(Duration::from_millis(20)),
    );
    let runs = Arc::new(AtomicU32::new(0));
    let broken = stream::iter(vec![Ok(Bytes::from_static(b"{")), Err("reset".to_owned())]);
    let (refused, _) = answer(
        keyed(&engine, "k")
            .respond("kept", None, broken, charge(&runs))
            .await,
    );
    assert_eq!(
        (refused.status, problem_type(&refused).as_str()),
        (400, "body-unreadable")
    );
    let stalled = stream::pending::<Result<Bytes, String>>();
    let outcome = keyed(&engine, "k")
        .respond("kept", None, stalled, charge(&runs))
        .await;
    let Outcome::Answer {
        answer: refused, ..
    } = outcome
    else {
        panic!("a stalled body is answered");
    };
    assert_eq!(
        (refused.status, problem_type(&refused).as_str()),
        (408, "body-timeout")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_failed_or_panicking_handler_releases_its_claim() {
    let engine = Engine::new(MemoryStore::new(), Policy::required());
    let failing = |_: &'static str, _: Bytes, _: ExecutionInfo| async {
        Err::<Handled<u16, Body>, _>("database down")
    };
    match keyed(&engine, "k")
        .respond("kept", None, chunks(&[]), failing)
        .await
    {
        Outcome::Failed(error) => assert_eq!(error, "database down"),
        other => panic!("{other:?}"),
    }
    let panicking = |_: &'static str, _: Bytes, _: ExecutionInfo| async {
        if true {
            panic!("the handler's bug");
        }
        Ok::<Handled<u16, Body>, &'static str>(Handled {
            head: 0,
            status: 200,
            headers: vec![],
            body: HandlerBody::Complete(Bytes::new()),
        })
    };
    let (failed, remnant) = answer(
        keyed(&engine, "k")
            .respond("kept", None, chunks(&[]), panicking)
            .await,
    );
    assert_eq!(
        (failed.status, problem_type(&failed).as_str()),
        (500, "handler-failed")
    );
    assert!(matches!(remnant, Remnant::Lost));
    // Both released their claim: the retry runs.
    let runs = Arc::new(AtomicU32::new(0));
    assert!(matches!(
        send(&engine, "k", &[], &runs).await,
        Outcome::Deliver { .. }
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_that_fails_while_read_is_answered_with_the_handlers_head() {
    let engine = Engine::new(MemoryStore::new(), Policy::required());
    let broken = |_: &'static str, _: Bytes, _: ExecutionInfo| async {
        Ok::<_, &'static str>(Handled {
            head: 7_u16,
            status: 200,
            headers: vec![],
            body: HandlerBody::Streaming {
                body: stream::iter(vec![Ok(Bytes::from_static(b"par")), Err("cut".to_owned())]),
                length: None,
            },
        })
    };
    let (failed, remnant) = answer(
        keyed(&engine, "k")
            .respond("kept", None, chunks(&[]), broken)
            .await,
    );
    assert_eq!(failed.status, 500);
    assert!(matches!(remnant, Remnant::Handled(7)));
}

#[tokio::test]
async fn an_answer_over_the_stored_limit_is_sent_on_and_not_recorded() {
    let engine = Engine::new(MemoryStore::new(), Policy::required().stored_body_limit(4));
    let streaming = |_: &'static str, _: Bytes, _: ExecutionInfo| async {
        Ok::<_, &'static str>(Handled {
            head: 200_u16,
            status: 200,
            headers: vec![],
            body: HandlerBody::Streaming {
                body: stream::iter(vec![
                    Ok::<_, String>(Bytes::from_static(b"abc")),
                    Ok(Bytes::from_static(b"def")),
                    Ok(Bytes::from_static(b"g")),
                ]),
                length: None,
            },
        })
    };
    match keyed(&engine, "k")
        .respond("kept", None, chunks(&[]), streaming)
        .await
    {
        Outcome::Deliver {
            body: Delivered::Resumed { read, rest },
            ..
        } => {
            assert_eq!(&read[..], b"abcdef");
            let rest: Vec<_> = futures_util::StreamExt::collect(rest).await;
            assert_eq!(rest.len(), 1);
        }
        other => panic!("{other:?}"),
    }
    let runs = Arc::new(AtomicU32::new(0));
    let (retry, _) = answer(send(&engine, "k", &[], &runs).await);
    assert_eq!(problem_type(&retry), "response-not-stored");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_handler_whose_caller_goes_away_finishes_and_is_recorded() {
    let engine = Engine::new(MemoryStore::new(), Policy::required());
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let ran = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&ran);
    let slow = move |_: &'static str, _: Bytes, _: ExecutionInfo| async move {
        let _ = released.await;
        counted.fetch_add(1, Ordering::SeqCst);
        Ok::<_, &'static str>(Handled {
            head: 201_u16,
            status: 201,
            headers: vec![],
            body: HandlerBody::<Body>::Complete(Bytes::from_static(b"done")),
        })
    };
    let mut pending = Box::pin(keyed(&engine, "k").respond("kept", None, chunks(&[]), slow));
    assert!(
        std::future::poll_fn(|cx| Poll::Ready(pending.as_mut().poll(cx)))
            .await
            .is_pending()
    );
    // The client goes away while the handler runs.
    drop(pending);
    release.send(()).unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let replay = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match keyed(&engine, "k")
                .respond("kept", None, chunks(&[]), charge(&runs))
                .await
            {
                Outcome::Answer { answer, .. } if answer.status == 201 => return answer,
                _ => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    })
    .await
    .expect("the detached run completes the record");
    assert_eq!(&replay.body[..], b"done");
    assert_eq!(
        (ran.load(Ordering::SeqCst), runs.load(Ordering::SeqCst)),
        (1, 0)
    );
}

#[tokio::test]
async fn respond_local_runs_a_handler_that_is_not_send() {
    let engine = Engine::new(MemoryStore::new(), Policy::required());
    let local = tokio::task::LocalSet::new();
    let outcome = local
        .run_until(async {
            let not_send = std::rc::Rc::new(201_u16);
            keyed(&engine, "k")
                .respond_local("kept", None, chunks(&["x"]), move |_, body, _| async move {
                    Ok::<_, Infallible>(Handled {
                        head: *not_send,
                        status: *not_send,
                        headers: vec![],
                        body: HandlerBody::<Body>::Complete(body),
                    })
                })
                .await
        })
        .await;
    match outcome {
        Outcome::Deliver {
            head,
            body: Delivered::Complete(body),
        } => assert_eq!((head, &body[..]), (201, &b"x"[..])),
        other => panic!("{other:?}"),
    }
    let runs = Arc::new(AtomicU32::new(0));
    let (replay, _) = answer(send(&engine, "k", &["x"], &runs).await);
    assert_eq!((replay.status, runs.load(Ordering::SeqCst)), (201, 0));
}

#[cfg(feature = "test-util")]
#[tokio::test]
async fn a_store_that_fails_answers_503_without_running_the_handler() {
    let engine = Engine::new(
        crate::faults::FaultyStore::new(
            MemoryStore::new(),
            crate::faults::FaultPlan::seeded(1).error_rate(1.0),
        ),
        Policy::required(),
    );
    let runs = Arc::new(AtomicU32::new(0));
    let (refused, _) = answer(send(&engine, "k", &[], &runs).await);
    assert_eq!(
        (refused.status, problem_type(&refused).as_str()),
        (503, "store-unavailable")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}
