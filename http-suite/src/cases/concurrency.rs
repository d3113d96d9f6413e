//! Requests that meet while one of them runs: conflicts, waiting, many at once,
//! clients that give up, handlers slower than their lease (`docs/contract.md` §1, §4, §5).

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::Target;
use crate::client::{
    Answer, Call, Client, Executions, assert_executed, assert_problem, assert_replay_of,
};

/// How many requests with one key the concurrency cases send at once.
const CROWD: usize = 100;

pub(crate) fn spawn_send(client: &Client, call: &Call) -> JoinHandle<Answer> {
    let (client, call) = (client.clone(), call.clone());
    tokio::spawn(async move { client.send(&call).await })
}

pub(crate) async fn joined(handle: JoinHandle<Answer>) -> Answer {
    handle
        .await
        .unwrap_or_else(|error| panic!("a request task failed: {error}"))
}

pub(crate) fn assert_retry_after(answer: &Answer) {
    let value = answer.header("retry-after");
    let seconds: u64 = value
        .parse()
        .unwrap_or_else(|_| panic!("Retry-After is not a number of seconds: {value:?}"));
    assert!(seconds >= 1, "Retry-After: {seconds}");
}

pub(crate) async fn in_progress_is_a_conflict_with_retry_after(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/required?gate=held", "busy-1", "{}");
    let first = spawn_send(&client, &call);
    client.await_started(1).await;

    let conflict = client.send(&call).await;
    assert_problem(&conflict, 409, "request-in-progress");
    assert_retry_after(&conflict);
    // A different request with the key is refused as such even while it runs.
    let other = client
        .send(&Call::post("/required?gate=held", "busy-1", "{\"x\":1}"))
        .await;
    assert_problem(&other, 422, "key-reused");

    client.open_gate("held").await;
    let first = joined(first).await;
    assert_executed(&first, 201);
    assert_replay_of(&client.send(&call).await, &first);
    assert_eq!(client.executions().await.started, 1);
}

pub(crate) async fn wait_mode_waits_then_replays(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/wait?gate=held", "wait-1", "{}");
    let first = spawn_send(&client, &call);
    client.await_started(1).await;
    let second = spawn_send(&client, &call);
    // Give the second request time to arrive; it must not be answered while the
    // first is held (an early answer would be a 409 or a second execution).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the waiting request was answered while the first was still running"
    );
    client.open_gate("held").await;
    let first = joined(first).await;
    assert_executed(&first, 201);
    assert_replay_of(&joined(second).await, &first);
    assert_eq!(client.executions().await.started, 1);
}

pub(crate) async fn wait_past_its_bound_is_a_conflict(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/wait-briefly?gate=held", "wait-2", "{}");
    let first = spawn_send(&client, &call);
    client.await_started(1).await;
    let conflict = client.send(&call).await;
    assert_problem(&conflict, 409, "request-in-progress");
    assert_retry_after(&conflict);
    client.open_gate("held").await;
    let first = joined(first).await;
    assert_executed(&first, 201);
    assert_replay_of(&client.send(&call).await, &first);
    assert_eq!(client.executions().await.started, 1);
}

async fn crowd(client: &Client, call: &Call) -> Vec<Answer> {
    let handles: Vec<_> = (0..CROWD).map(|_| spawn_send(client, call)).collect();
    let mut answers = Vec::with_capacity(CROWD);
    for handle in handles {
        answers.push(joined(handle).await);
    }
    answers
}

/// The one answer in `answers` that ran the handler.
pub(crate) fn the_executed_one(answers: &[Answer]) -> Answer {
    let executed: Vec<&Answer> = answers
        .iter()
        .filter(|answer| answer.status == 201 && !answer.is_replay())
        .collect();
    match executed.as_slice() {
        [one] => (*one).clone(),
        many => panic!("expected one executed answer, found {}", many.len()),
    }
}

pub(crate) async fn concurrent_requests_with_one_key_execute_once(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/required?delay_ms=300", "crowd-1", "{}");
    let answers = crowd(&client, &call).await;
    let first = the_executed_one(&answers);
    for answer in &answers {
        match answer.status {
            409 => {
                assert_problem(answer, 409, "request-in-progress");
            }
            _ if answer.is_replay() => assert_replay_of(answer, &first),
            _ => assert_eq!(answer, &first, "the one executed answer"),
        }
    }
    assert_eq!(
        client.executions().await,
        Executions {
            started: 1,
            finished: 1
        }
    );
}

pub(crate) async fn concurrent_requests_in_wait_mode_get_one_answer(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/wait?delay_ms=300", "crowd-2", "{}");
    let answers = crowd(&client, &call).await;
    let first = the_executed_one(&answers);
    for answer in answers.iter().filter(|answer| answer.is_replay()) {
        assert_replay_of(answer, &first);
    }
    assert_eq!(
        answers.iter().filter(|answer| answer.is_replay()).count(),
        CROWD - 1
    );
    assert_eq!(client.executions().await.started, 1);
}

pub(crate) async fn client_disconnect_does_not_cancel_the_handler(target: Target) {
    let client = Client::new(&target);
    let call = Call::post("/wait?gate=held", "gone-1", "{}");
    let gone = {
        let (client, call) = (client.clone(), call.clone());
        tokio::spawn(async move { client.send(&call).await })
    };
    client.await_started(1).await;
    // The client gives up: its request future is dropped, its connection closed.
    gone.abort();
    let _ = gone.await;
    // Let the server see the closed connection before the handler may finish.
    tokio::time::sleep(Duration::from_millis(200)).await;
    client.open_gate("held").await;
    client
        .await_executions("the abandoned handler finished", |e| e.finished == 1)
        .await;

    let retry = client.send(&call).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.is_replay(), "the retry replays the abandoned answer");
    assert_eq!(retry.execution(), 1);
    assert_eq!(
        client.executions().await,
        Executions {
            started: 1,
            finished: 1
        }
    );
}

pub(crate) async fn handler_slower_than_its_lease_runs_once(target: Target) {
    let client = Client::new(&target);
    // The lease is 1 s; the handler takes 2.5 s.
    let call = Call::post("/short-lease?delay_ms=2500", "slow-1", "{}");
    let first = spawn_send(&client, &call);
    client.await_started(1).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = client.send(&call).await;
    let first = joined(first).await;
    assert_executed(&first, 201);
    if retry.is_replay() {
        // A slow machine: the first finished before the retry arrived.
        assert_replay_of(&retry, &first);
    } else {
        assert_problem(&retry, 409, "request-in-progress");
    }
    assert_replay_of(&client.send(&call).await, &first);
    assert_eq!(client.executions().await.started, 1);
}
