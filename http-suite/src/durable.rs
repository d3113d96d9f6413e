//! Cases for durable stores, beyond one app over a store of its own: instances of
//! an application sharing one store (`docs/contract.md` §1: exactly one claimer wins
//! "across processes and machines"; §6: PostgreSQL "shared by many app
//! instances"), and a store that goes away under a running app and comes back
//! (§4: a store that is unreachable fails closed).
//!
//! They are not in [`cases`](crate::cases): each needs more than a fresh app, so
//! the test file that owns the database calls them with what they need: several
//! apps over one database, or an app and a way to stop its database server.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use idem_core::Store;
use idem_testkit::postgres::DEFAULT_DATABASE;
use idem_testkit::{Error as ClusterError, TestPostgres};

use crate::Target;
use crate::cases::{assert_retry_after, joined, spawn_send, the_executed_one};
use crate::client::{
    Answer, Call, Client, Executions, assert_executed, assert_problem, assert_replay_of,
};
use crate::stores::{TempDir, fresh_postgres_url, migrated_postgres, migrated_sqlite};

/// How many requests with one key [`one_key_over_instances_executes_once`]
/// sends at once, spread over the instances.
pub const INSTANCES_CROWD: usize = 200;

/// The future of a [`StoreServer`] step.
pub type ServerFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// The database server behind a durable store, which
/// [`store_outage_fails_closed_then_recovers`] stops and starts again under a
/// running app. Each step panics when it cannot be done.
pub trait StoreServer: Send + Sync {
    /// Stops the server, closing its open connections; resolves once it is down.
    fn stop(&self) -> ServerFuture<'_>;

    /// Starts it again with its data, at the same address; resolves once it
    /// accepts connections.
    fn resume(&self) -> ServerFuture<'_>;
}

/// Apps that share one store: [`INSTANCES_CROWD`] concurrent requests with one
/// key against a slow handler, sent to the `instances` in turn.
///
/// Exactly one handler runs, counted over every instance (each instance's
/// `GET /executions`, summed): the store's exclusion holds across the
/// instances' separate connection pools. Every other answer is a
/// `409 request-in-progress` or a byte-identical replay of the one executed
/// answer, and afterwards every instance replays it.
///
/// `instances` are separately built apps (each with its own store value and
/// pool) over one database; they may be different adapters.
///
/// # Panics
///
/// When the instances misbehave, or when there are fewer than two.
pub async fn one_key_over_instances_executes_once(instances: Vec<Target>) {
    assert!(instances.len() >= 2, "the case needs two instances or more");
    let clients: Vec<Client> = instances.iter().map(Client::new).collect();
    let call = Call::post("/required?delay_ms=300", "instances-1", "{\"amount\":5}");
    let handles: Vec<_> = (0..INSTANCES_CROWD)
        .map(|i| spawn_send(&clients[i % clients.len()], &call))
        .collect();
    let mut answers = Vec::with_capacity(INSTANCES_CROWD);
    for handle in handles {
        answers.push(joined(handle).await);
    }

    let first = the_executed_one(&answers);
    for answer in &answers {
        match answer.status {
            409 => {
                assert_problem(answer, 409, "request-in-progress");
                assert_retry_after(answer);
            }
            _ if answer.is_replay() => assert_replay_of(answer, &first),
            _ => assert_eq!(answer, &first, "the one executed answer"),
        }
    }
    assert_eq!(
        executions_over(&clients).await,
        Executions {
            started: 1,
            finished: 1
        },
        "handlers run over every instance"
    );
    for client in &clients {
        assert_replay_of(&client.send(&call).await, &first);
    }
    assert_eq!(executions_over(&clients).await.started, 1);
}

/// The store's database server stops under a running app, then starts again.
///
/// - **While it is down**, keyed requests fail closed: `503 store-unavailable`
///   with `Retry-After`, nothing of the store's error in the answer, and no
///   handler runs, for a new key, for its retry, and for the key of an answer
///   recorded before the outage (its replay needs the store too). A fail-open
///   route runs its handler unguarded.
/// - **A request in flight** (claimed before the outage, its handler running
///   when the store goes away, then finishing while it is down): its client gets
///   the handler's answer. The handler has run and its effect happened outside
///   the store; withholding the answer would only turn the client's retry into
///   a `409`. The answer cannot be recorded yet, so the engine goes on
///   recording it in the background while the claim's lease holds: a retry is
///   refused with `409 request-in-progress` until the store is back, then
///   replays the answer, and the handler never runs a second time. (The
///   route's lease is an hour, so the case does not depend on how long the
///   outage takes. An outage longer than the lease lets the record lapse, and
///   a retry then runs the handler again: exactly one effect across any outage
///   is what transactional mode, `docs/contract.md` §7, is for.)
/// - **Once it is back**, the same app recovers without a restart: the key
///   refused during the outage executes, its retry replays byte for byte, and
///   the answer recorded before the outage replays.
///
/// # Panics
///
/// When the app misbehaves, or when `server` cannot stop or start.
pub async fn store_outage_fails_closed_then_recovers(target: Target, server: &dyn StoreServer) {
    let client = Client::new(&target);
    let before_call = Call::post("/required", "outage-before", "{}");
    let before = client.send(&before_call).await;
    assert_executed(&before, 201);

    let in_flight_call = Call::post("/long-lease?gate=outage", "outage-in-flight", "{}");
    let in_flight = spawn_send(&client, &in_flight_call);
    // Its handler has started, so its claim is made.
    client.await_started(2).await;

    server.stop().await;

    let during_call = Call::post("/required", "outage-during", "{}");
    for call in [&during_call, &during_call, &before_call, &in_flight_call] {
        let refused = client.send(call).await;
        assert_problem(&refused, 503, "store-unavailable");
        assert_retry_after(&refused);
        assert_leaks_nothing(&refused);
    }
    assert_eq!(
        client.executions().await.started,
        2,
        "no handler runs while the store is down"
    );
    let unguarded = client
        .send(&Call::post("/fail-open", "outage-open", "{}"))
        .await;
    assert_executed(&unguarded, 201);
    assert_eq!(unguarded.execution(), 3);

    // The handler in flight finishes while the store is down.
    client.open_gate("outage").await;
    let in_flight = joined(in_flight).await;
    assert_executed(&in_flight, 201);
    assert_eq!(in_flight.execution(), 2);

    server.resume().await;

    let after = client.send(&during_call).await;
    assert_executed(&after, 201);
    assert_eq!(after.execution(), 4);
    assert_replay_of(&client.send(&during_call).await, &after);
    assert_replay_of(&client.send(&before_call).await, &before);
    // The in-flight answer could not be recorded while the store was down; it
    // is recorded once the store is back (while its lease holds), so the
    // retry, refused with 409 until then, replays it: one effect.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let retry = client.send(&in_flight_call).await;
        if retry.status == 409 {
            assert_problem(&retry, 409, "request-in-progress");
            assert_retry_after(&retry);
            assert!(
                tokio::time::Instant::now() < deadline,
                "the in-flight answer was never recorded after the store came back"
            );
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            continue;
        }
        assert_replay_of(&retry, &in_flight);
        break;
    }
    assert_eq!(
        client.executions().await,
        Executions {
            started: 4,
            finished: 4
        }
    );
}

/// The executions of every instance, summed.
async fn executions_over(clients: &[Client]) -> Executions {
    let mut total = Executions {
        started: 0,
        finished: 0,
    };
    for client in clients {
        let executions = client.executions().await;
        total.started += executions.started;
        total.finished += executions.finished;
    }
    total
}

/// Asserts that a store failure's answer says nothing of its cause: the generic
/// detail, no database error, no address.
fn assert_leaks_nothing(answer: &Answer) {
    let body = String::from_utf8_lossy(&answer.body).to_lowercase();
    for word in ["refused", "postgres", "sqlite", "127.0.0.1", "connection"] {
        assert!(
            !body.contains(word),
            "the answer tells the client about the store ({word:?}): {body}"
        );
    }
}

/// How a test file starts its app over a store, boxed so that instances of
/// different adapters can be started side by side.
pub type Start = fn(Arc<dyn Store>) -> Pin<Box<dyn Future<Output = Target> + Send>>;

/// [`one_key_over_instances_executes_once`] over one instance per `starts`,
/// each with a `PgStore` (a pool) of its own over one fresh database of the
/// binary's shared cluster.
///
/// # Panics
///
/// When PostgreSQL cannot be started or the instances misbehave.
pub async fn instances_over_one_postgres_database(starts: &[Start]) {
    let url = fresh_postgres_url("instances").await;
    let mut instances = Vec::new();
    for start in starts {
        instances.push(start(Arc::new(migrated_postgres(&url).await)).await);
    }
    one_key_over_instances_executes_once(instances).await;
}

/// [`one_key_over_instances_executes_once`] over one instance per `starts`,
/// each with a `SqliteStore` of its own over one file.
///
/// # Panics
///
/// When the file cannot be made or the instances misbehave.
pub async fn instances_over_one_sqlite_file(starts: &[Start]) {
    let dir = TempDir::new("scenarios").unwrap_or_else(|error| panic!("a directory: {error}"));
    let path = dir.file("idem.db");
    let mut instances = Vec::new();
    for start in starts {
        instances.push(start(Arc::new(migrated_sqlite(&path).await)).await);
    }
    one_key_over_instances_executes_once(instances).await;
}

/// [`store_outage_fails_closed_then_recovers`] with PostgreSQL: a cluster of
/// the test's own (it is stopped), under the app `start` builds.
///
/// # Panics
///
/// When PostgreSQL cannot be started or the app misbehaves.
pub async fn postgres_outage(start: Start) {
    let cluster = Arc::new(
        tokio::task::spawn_blocking(TestPostgres::start)
            .await
            .unwrap_or_else(|error| panic!("the cluster's task failed: {error}"))
            .unwrap_or_else(|error| panic!("cannot start a PostgreSQL cluster: {error}")),
    );
    let store = migrated_postgres(&cluster.url(DEFAULT_DATABASE)).await;
    let target = start(Arc::new(store)).await;
    store_outage_fails_closed_then_recovers(target, &Stoppable(Arc::clone(&cluster))).await;
    // Stopped and deleted here, on a blocking thread (the app's pools go with
    // the runtime).
    let _ = tokio::task::spawn_blocking(move || drop(cluster)).await;
}

/// A test cluster as the outage case stops and resumes it.
struct Stoppable(Arc<TestPostgres>);

impl StoreServer for Stoppable {
    fn stop(&self) -> ServerFuture<'_> {
        let cluster = Arc::clone(&self.0);
        Box::pin(blocking(move || cluster.stop()))
    }

    fn resume(&self) -> ServerFuture<'_> {
        let cluster = Arc::clone(&self.0);
        Box::pin(blocking(move || cluster.resume()))
    }
}

/// Runs a step of the cluster on a blocking thread; panics with its error.
async fn blocking(step: impl FnOnce() -> Result<(), ClusterError> + Send + 'static) {
    tokio::task::spawn_blocking(step)
        .await
        .unwrap_or_else(|error| panic!("the cluster's task failed: {error}"))
        .unwrap_or_else(|error| panic!("the test cluster failed: {error}"));
}

/// Generates the durable-store tests for an adapter whose test file starts its
/// app with `start` (an `async fn(Arc<dyn Store>) -> Target`): two instances
/// over one PostgreSQL database and over one SQLite file, and PostgreSQL
/// stopped under the running app.
#[macro_export]
macro_rules! durable_tests {
    ($start:path $(,)?) => {
        /// Two instances, each with its own `PgStore` (its own pool), over one
        /// database: 200 concurrent requests with one key, spread over both.
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn two_instances_share_one_postgres_database() {
            let start: $crate::durable::Start = |store| ::std::boxed::Box::pin($start(store));
            $crate::durable::instances_over_one_postgres_database(&[start, start]).await;
        }

        /// Two instances, each with its own `SqliteStore` (its own pool), over
        /// one file.
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn two_instances_share_one_sqlite_file() {
            let start: $crate::durable::Start = |store| ::std::boxed::Box::pin($start(store));
            $crate::durable::instances_over_one_sqlite_file(&[start, start]).await;
        }

        /// PostgreSQL stops under the running app, then starts again.
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn postgres_outage_fails_closed_then_recovers() {
            $crate::durable::postgres_outage(|store| ::std::boxed::Box::pin($start(store))).await;
        }
    };
}
