//! The checks both payments example binaries pass as processes, so that
//! `payments-axum` and `payments-actix` are held to the same behaviour by the
//! same code. Test machinery, not part of the examples: a workspace-internal,
//! unpublished crate that each example takes as a dev-dependency. Each example
//! has one test binary, `tests/binary.rs` (`harness = false`), which is one line:
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     payments_harness::run("/path/to/payments-axum") // env!("CARGO_BIN_EXE_payments-axum")
//! }
//! ```
//!
//! [`run`] is the test binary's harness (libtest-mimic, so the usual filters
//! and `--list` work): it runs the trials, starting a throwaway PostgreSQL
//! cluster (idem-testkit's `TestPostgres`) when the first trial that needs one
//! asks for a database, giving each such trial a fresh database, and removes
//! the cluster at the end. The `service::` trials use the memory and SQLite
//! stores only: run alone (`cargo test -p payments-axum -- service::`), they
//! start no cluster. Servers are started with `--listen 127.0.0.1:0` and
//! killed (`SIGKILL`) when a trial is done with them, or drops them on a
//! failure.
//!
//! The trials on PostgreSQL (some on every store):
//!
//! - **the crash test** (`crash::sigkill_mid_charge_applies_each_charge_exactly_once`):
//!   rounds of a server started with a random `--provider-latency-ms`, a batch
//!   of charges with distinct keys (some sent twice at once), fired at random
//!   moments, and a `SIGKILL`: in turn while the test holds the account's row
//!   (so that charges are caught inside their transactions), as soon as the
//!   first charge is answered (others are committing or answering), or after
//!   a random delay. Then a new server on the same database, and every key
//!   retried until it gets its `201`. The ledger must prove one effect per key:
//!   `operations` is the number of keys, `balance` their sum, one charge row per
//!   key, whose id is the receipt's; every answer seen before the kill is
//!   replayed byte for byte; no record is left in progress. Set
//!   `PAYMENTS_CRASH_SEED` to replay a run (a failure prints its seed).
//! - a duplicate arriving while the first request's transaction is open waits
//!   for the commit and replays the committed answer;
//! - the ledger and the records survive a restart;
//! - deposits (keyed and not), invalid bodies, an overflowing balance and two
//!   principals with one key, on PostgreSQL;
//! - on every store, a charge calls `--provider-url`'s provider once, with the
//!   charge as JSON and a forwarded `Idempotency-Key` stable per charge and
//!   distinct per principal and key; a declined or unreachable provider makes
//!   the charge a `502` that applies nothing, and the retry calls it again;
//!   `--help` lists `--provider-url` and `--lease-secs`;
//! - on every store, with `RUST_LOG=trace`, every kind of request leaves the
//!   scope in the log but never the bearer token, a full idempotency key or a
//!   request body.
//!
//! The `service::` trials, on memory and SQLite (`docs/contract.md` §8):
//!
//! - on `--store memory`, a retried charge replays its answer byte for byte
//!   and charges once, and no database file is written;
//! - without `--store`, records and ledger go to `payments.db` in the working
//!   directory and survive a restart (the retry replays, once);
//! - `--help` shows `--retention-secs` (86400) and `--cleanup-interval-secs`
//!   (60) with their defaults; with a retention of a second, a charge retried
//!   past it runs afresh;
//! - an unknown `--store` exits with an error naming it, and listens nowhere;
//! - a charge answers `201` and exactly its receipt; without a key it is a
//!   `400` `missing-key`, without a bearer token a `401` `unauthorized`,
//!   applying nothing;
//! - deposits without a key take effect every time, with one once;
//! - an invalid body is a `400` `invalid-request`, replayed on retry;
//! - two principals with one key make two charges;
//! - twenty charges at once with one key are `201`s or `409`s and charge once.
//!
//! Every answer's `Idempotent-Replayed` header is either absent or `true`, and
//! every `GET /accounts/{id}` is exactly `{"account_id", "balance", "operations"}`.

// Test support: a failed expectation is a panic, which fails the trial.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod crash;
mod database;
mod logs;
mod provider;
mod publish;
mod server;
mod service;
mod trials;

use std::any::Any;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_testkit::{TestPostgres, TestRabbitMq};
use libtest_mimic::{Arguments, Failed, Trial};

/// Runs every trial against `binary` (a payments example), as the harness of a
/// test binary: parses the test arguments, reports, and answers the exit code.
pub fn run(binary: &str) -> ExitCode {
    let args = Arguments::from_args();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("cannot start a Tokio runtime for the tests: {error}");
            return ExitCode::FAILURE;
        }
    };
    let suite = Arc::new(Suite {
        binary: PathBuf::from(binary),
        cluster: OnceLock::new(),
        broker: OnceLock::new(),
        databases: AtomicUsize::new(0),
    });
    let trials = TRIALS
        .iter()
        .map(|(name, test)| trial(&runtime, &suite, name, *test))
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    // Tasks left on the runtime (a trial that hung) may hold servers: ending
    // them kills the servers, and then the cluster can go.
    drop(runtime);
    match Arc::try_unwrap(suite) {
        Ok(suite) => drop(suite),
        Err(_) => eprintln!("warning: the test cluster is still in use and was not removed"),
    }
    conclusion.exit_code()
}

/// A trial: an async function over the suite that panics on failure.
type TestFn = fn(Arc<Suite>) -> Pin<Box<dyn Future<Output = ()> + Send>>;

/// `"prefix" => module::function, …` as `(name, TestFn)` pairs, each trial
/// named `prefix::function`.
macro_rules! trials {
    ($($prefix:literal => $module:ident :: $test:ident),* $(,)?) => {
        &[$((
            concat!($prefix, "::", stringify!($test)),
            |suite| Box::pin($module::$test(suite)),
        )),*]
    };
}

/// Every trial, by name.
const TRIALS: &[(&str, TestFn)] = trials![
    "crash" => crash::sigkill_mid_charge_applies_each_charge_exactly_once,
    "transactional" => trials::a_duplicate_during_the_transaction_replays_the_committed_answer,
    "ledger" => trials::the_ledger_and_the_records_survive_a_restart,
    "provider" => provider::a_charge_calls_the_provider_once_with_a_stable_forwarded_key,
    "provider" => provider::a_failed_provider_call_is_a_502_and_the_retry_calls_again,
    "provider" => provider::help_lists_the_provider_and_lease_flags,
    "logs" => logs::no_token_key_or_body_in_the_log_at_trace,
    "routes" => trials::deposits_invalid_bodies_overflow_and_principals_on_postgres,
    "service" => service::the_binary_charges_once_per_key_on_the_memory_store,
    "service" => service::the_default_sqlite_store_keeps_records_and_ledger_across_a_restart,
    "service" => service::the_help_lists_retention_and_cleanup_interval_with_their_defaults,
    "service" => service::a_charge_retried_after_its_retention_runs_afresh,
    "service" => service::the_binary_refuses_an_unknown_store,
    "service" => service::a_charge_answers_its_receipt,
    "service" => service::a_charge_needs_a_key_and_a_principal,
    "service" => service::deposits_without_a_key_take_effect_every_time,
    "service" => service::an_invalid_body_is_a_400_problem_and_is_replayed,
    "service" => service::principals_do_not_share_keys,
    "service" => service::parallel_charges_with_one_key_charge_once,
    "publish" => publish::publish_needs_a_store_with_transactions,
    "publish" => publish::every_operation_applied_is_published_once,
];

/// How long a trial may run before it counts as hung (a guard against a hang,
/// far above what any trial takes).
const HANG: Duration = Duration::from_secs(600);

/// What the trials share: the binary under test and the cluster.
pub(crate) struct Suite {
    binary: PathBuf,
    cluster: OnceLock<Result<TestPostgres, String>>,
    /// A RabbitMQ node, for `--publish`; started on first use.
    broker: OnceLock<Result<TestRabbitMq, String>>,
    databases: AtomicUsize,
}

impl Suite {
    /// The binary under test.
    pub(crate) fn binary(&self) -> &std::path::Path {
        &self.binary
    }

    /// The shared cluster, started on first use; panics, saying why, when it
    /// cannot start.
    fn cluster(&self) -> &TestPostgres {
        let started = self
            .cluster
            .get_or_init(|| TestPostgres::start().map_err(|error| error_chain(&error)));
        match started {
            Ok(cluster) => cluster,
            Err(error) => panic!("could not start the PostgreSQL test cluster: {error}"),
        }
    }

    /// The AMQP URL of the shared RabbitMQ node, started on first use.
    pub(crate) async fn broker_url(self: &Arc<Self>) -> String {
        let suite = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let started = suite
                .broker
                .get_or_init(|| TestRabbitMq::start().map_err(|error| error_chain(&error)));
            match started {
                Ok(broker) => broker.url(),
                Err(error) => panic!("could not start the RabbitMQ test node: {error}"),
            }
        })
        .await
        .unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()))
    }

    /// The URL of a new, empty database on the cluster.
    pub(crate) async fn fresh_database(self: &Arc<Self>) -> String {
        let suite = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let name = format!(
                "payments_{}",
                suite.databases.fetch_add(1, Ordering::Relaxed)
            );
            let cluster = suite.cluster();
            if let Err(error) = cluster.create_database(&name) {
                panic!("{}", error_chain(&error));
            }
            cluster.url(&name)
        })
        .await
        .unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()))
    }
}

/// A trial that runs `test` on the shared runtime, as a task of its own, so
/// that its panic becomes the trial's failure message.
fn trial(runtime: &tokio::runtime::Runtime, suite: &Arc<Suite>, name: &str, test: TestFn) -> Trial {
    let handle = runtime.handle().clone();
    let suite = Arc::clone(suite);
    Trial::test(name, move || {
        handle.block_on(async move {
            let task = tokio::spawn(test(suite));
            match tokio::time::timeout(HANG, task).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(error)) if error.is_panic() => Err(panic_message(error.into_panic())),
                Ok(Err(error)) => Err(Failed::from(error.to_string())),
                Err(_) => Err(Failed::from(format!("did not finish within {HANG:?}"))),
            }
        })
    })
}

fn panic_message(payload: Box<dyn Any + Send>) -> Failed {
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panicked".to_owned());
    Failed::from(message)
}

pub(crate) use idem_core::log::error_chain;
