//! A deterministic simulation of one execution per key under store faults.
//!
//! For each seed, on Tokio's paused clock: a `MemoryStore` behind a
//! [`FaultyStore`] that fails 2 % of steps at once, delays 10 % by up to 200 ms,
//! and goes away entirely in up to two outages, each shorter than the renewal
//! margin (half the lease) and far apart; several keys, each sent by several
//! clients at random moments, in wait or reject mode, retrying every 250 ms
//! until they get an answer; handlers faster and slower than the lease.
//!
//! The invariants: at most one handler execution per key, every client ends
//! with the one execution's answer, and afterwards no record is left in
//! progress past its lease.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use idem_core::faults::{FaultPlan, FaultyStore};
use idem_core::{
    Begin, Engine, Fingerprint, IdempotencyKey, InProgress, MemoryStore, Policy, Scope, Settlement,
    StoredResponse,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SEEDS: u64 = 2_000;
const KEYS: usize = 3;
const CLIENTS_PER_KEY: usize = 4;
const LEASE: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Totals {
    faults: AtomicU64,
    executions: AtomicU64,
    duplicates: AtomicU64,
}

#[test]
fn one_execution_per_key_under_store_faults() {
    let totals = Arc::new(Totals::default());
    // Each seed is a world of its own, on a runtime of its own: the seeds are
    // shared out among one thread per core (seed `s` to thread `s % threads`),
    // each running its seeds one after another, as the whole run did before.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let workers: Vec<_> = (0..threads)
        .map(|first| {
            let totals = Arc::clone(&totals);
            std::thread::spawn(move || {
                for seed in (first..SEEDS).step_by(threads as usize) {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .start_paused(true)
                        .build()
                        .unwrap();
                    runtime.block_on(simulate(seed, Arc::clone(&totals)));
                }
            })
        })
        .collect();
    for worker in workers {
        // A seed's failed assertion fails the test with its own message.
        if let Err(panic) = worker.join() {
            std::panic::resume_unwind(panic);
        }
    }
    let faults = totals.faults.load(Ordering::Relaxed);
    let executions = totals.executions.load(Ordering::Relaxed);
    let duplicates = totals.duplicates.load(Ordering::Relaxed);
    println!(
        "simulation: {SEEDS} seeds, {faults} faults injected, {executions} executions, {duplicates} duplicate requests answered without running"
    );
    assert_eq!(executions, SEEDS * KEYS as u64, "one execution per key");
    assert!(faults > SEEDS, "the plan injected faults");
}

async fn simulate(seed: u64, totals: Arc<Totals>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut plan = FaultPlan::seeded(seed)
        .error_rate(0.02)
        .delays(0.1, Duration::from_millis(200));
    // Outages shorter than the renewal margin, a lease or more apart.
    let mut at = Duration::from_secs(rng.random_range(0..20));
    for _ in 0..rng.random_range(0..=2) {
        let lasting = Duration::from_millis(rng.random_range(100..15_000));
        plan = plan.outage(at, lasting);
        at += lasting + LEASE + Duration::from_secs(rng.random_range(0..30));
    }
    let memory = MemoryStore::new();
    let store = Arc::new(FaultyStore::new(memory.clone(), plan.clone()));
    let mut tasks = Vec::new();
    let executions: Arc<Vec<AtomicU32>> = Arc::new((0..KEYS).map(|_| AtomicU32::new(0)).collect());
    for key in 0..KEYS {
        let handler_time = Duration::from_millis(rng.random_range(0..90_000));
        let policy = if rng.random_bool(0.5) {
            Policy::required().in_progress(InProgress::Wait {
                up_to: Duration::from_secs(rng.random_range(1..60)),
            })
        } else {
            Policy::required()
        };
        let engine = Engine::from_shared(store.clone(), policy.lease(LEASE));
        for _ in 0..CLIENTS_PER_KEY {
            let arrival = Duration::from_millis(rng.random_range(0..60_000));
            let engine = engine.clone();
            let executions = Arc::clone(&executions);
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(arrival).await;
                client(&engine, key, handler_time, &executions).await
            }));
        }
    }
    let mut answers = vec![Vec::new(); KEYS];
    for (i, task) in tasks.into_iter().enumerate() {
        let (body, ran) = task.await.unwrap();
        answers[i / CLIENTS_PER_KEY].push(body);
        if !ran {
            totals.duplicates.fetch_add(1, Ordering::Relaxed);
        }
    }
    for (key, count) in executions.iter().enumerate() {
        let count = count.load(Ordering::SeqCst);
        assert_eq!(
            count,
            1,
            "seed {seed}: key {key} ran {count} times (outages {:?})",
            plan.outages()
        );
        totals
            .executions
            .fetch_add(u64::from(count), Ordering::Relaxed);
        let first = &answers[key][0];
        assert!(
            answers[key].iter().all(|body| body == first),
            "seed {seed}: key {key}'s clients got different answers: {:?}",
            answers[key]
        );
    }
    totals.faults.fetch_add(store.injected(), Ordering::Relaxed);

    // Past every lease, nothing is left in progress.
    tokio::time::sleep(LEASE + Duration::from_secs(1)).await;
    let clean = Engine::new(memory, Policy::required());
    for key in 0..KEYS {
        match clean.begin(scope(), key_of(key), fingerprint()).await {
            Begin::Replay(_) => {}
            other => panic!("seed {seed}: key {key} is left {other:?}"),
        }
    }
}

/// Sends the key's request until it gets an answer other than `409`/`503`;
/// answers the body it got and whether it ran the handler.
async fn client(
    engine: &Engine,
    key: usize,
    handler_time: Duration,
    executions: &[AtomicU32],
) -> (bytes::Bytes, bool) {
    loop {
        match engine.begin(scope(), key_of(key), fingerprint()).await {
            Begin::Execute(execution) => {
                let run = executions[key].fetch_add(1, Ordering::SeqCst) + 1;
                let response = execution
                    .run(async {
                        tokio::time::sleep(handler_time).await;
                        StoredResponse::new(201, vec![], format!("key {key} run {run}"))
                    })
                    .await;
                assert!(matches!(
                    execution.settle(&response).await,
                    Settlement::Deliver
                ));
                return (response.body, true);
            }
            Begin::Replay(response) => return (response.body, false),
            Begin::Reject(problem) => {
                assert!(
                    matches!(problem.status, 409 | 503),
                    "unexpected {problem:?}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Begin::Unguarded => panic!("the routes fail closed"),
        }
    }
}

fn scope() -> Scope {
    Scope::new("sim")
}

fn key_of(key: usize) -> IdempotencyKey {
    IdempotencyKey::new(&format!("key-{key}")).unwrap()
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_bytes([9; 32])
}
