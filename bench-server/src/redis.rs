//! `redis-load`: the Redis store's own script calls, straight from Tokio tasks
//! and without HTTP, at a given concurrency: the ceiling of the layered route
//! on `RedisStore` on the same server.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idem_core::store::{ClaimOutcome, ClaimRequest, OwnerToken};
use idem_core::{Fingerprint, IdempotencyKey, Scope, Store};
use idem_redis::RedisStore;

use crate::BoxError;
use crate::handler::{self, SCOPE};

/// What `redis-load` runs.
#[derive(Debug, clap::Args)]
pub(crate) struct LoadOptions {
    /// `redis://…` or `redis+cluster://…`.
    #[arg(long)]
    url: String,
    /// Concurrent callers (each one call at a time).
    #[arg(long)]
    concurrency: usize,
    /// `first` (claim a new key, then complete it: the two scripts of a first
    /// execution) or `replay` (claim a completed key: the one script of a replay).
    #[arg(long)]
    mode: Mode,
    /// Warm-up before measuring, in milliseconds.
    #[arg(long, default_value_t = 200)]
    warmup_ms: u64,
    /// How long to measure, in milliseconds.
    #[arg(long, default_value_t = 1_000)]
    duration_ms: u64,
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    First,
    Replay,
}

/// The replay pool of this helper (its own keys, under its own scope).
const REPLAY_POOL: usize = 1_000;

/// The request body size the layered route's records are made for.
const BODY: usize = 1024;

pub(crate) fn load(options: LoadOptions) -> Result<(), BoxError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.workers.max(1))
        .enable_all()
        .build()?
        .block_on(run(options))
}

async fn run(options: LoadOptions) -> Result<(), BoxError> {
    let store = Arc::new(RedisStore::connect(&options.url).await?);
    let scope = Scope::new(format!("{SCOPE}-direct"));
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    if options.mode == Mode::Replay {
        for n in 0..REPLAY_POOL {
            once(&store, &scope, &format!("replay-{n}"), Step::Prime).await?;
        }
    }
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let callers: Vec<_> = (0..options.concurrency.max(1))
        .map(|caller| {
            let store = Arc::clone(&store);
            let scope = scope.clone();
            let measuring = Arc::clone(&measuring);
            let stop = Arc::clone(&stop);
            let run_id = run_id.clone();
            let mode = options.mode;
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0_usize;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = match mode {
                        Mode::First => format!("{run_id}-{caller}-{n}"),
                        Mode::Replay => format!("replay-{}", (caller * 7919 + n) % REPLAY_POOL),
                    };
                    let started = Instant::now();
                    let step = match mode {
                        Mode::First => Step::First,
                        Mode::Replay => Step::Replay,
                    };
                    once(&store, &scope, &key, step).await?;
                    if measuring.load(Ordering::Relaxed) {
                        latencies.push(started.elapsed());
                    }
                }
                Ok::<_, BoxError>(latencies)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(options.warmup_ms)).await;
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_millis(options.duration_ms)).await;
    measuring.store(false, Ordering::Relaxed);
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for caller in callers {
        latencies.extend(caller.await??);
    }
    latencies.sort_unstable();
    let percentile = |p: f64| {
        let index = ((latencies.len() as f64 * p).ceil() as usize).saturating_sub(1);
        latencies
            .get(index)
            .map_or(0.0, |latency| latency.as_secs_f64() * 1000.0)
    };
    let json = serde_json::json!({
        "operations": latencies.len(),
        "seconds": seconds,
        "rate": latencies.len() as f64 / seconds,
        "p50_ms": percentile(0.50),
        "p99_ms": percentile(0.99),
    });
    println!("{json}");
    Ok(())
}

/// What one call of [`once`] does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Claims a new key and completes it.
    First,
    /// Claims a completed key.
    Replay,
    /// Makes sure the key is completed (claims and completes it, or finds it so).
    Prime,
}

/// One operation on `key`.
async fn once(store: &RedisStore, scope: &Scope, key: &str, step: Step) -> Result<(), BoxError> {
    let request = ClaimRequest {
        scope: scope.clone(),
        key: IdempotencyKey::new(key)?,
        fingerprint: Fingerprint::from_bytes([1; 32]),
        owner: OwnerToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    };
    match (store.claim(&request).await?, step) {
        (ClaimOutcome::Claimed(claim), Step::First | Step::Prime) => {
            store
                .complete(&claim, &handler::recorded(BODY), request.retention)
                .await?;
            Ok(())
        }
        (ClaimOutcome::Completed { .. }, Step::Replay | Step::Prime) => Ok(()),
        (other, _) => Err(format!("{key}: unexpected claim outcome {other:?}").into()),
    }
}
