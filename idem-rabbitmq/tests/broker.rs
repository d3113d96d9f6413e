//! idem-rabbitmq against a real RabbitMQ node: one throwaway node for the
//! binary (stopped when the trials end), a queue per case, `MemoryInbox` as
//! the inbox and an in-memory ledger as the effect.
//!
//! Every wait is bounded and fails loudly with what it waited for and what
//! it last saw; none waits for readiness by sleeping. The case that stops
//! the broker runs alone (the others hold a shared lock).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::fmt::Display;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use idem_core::retry::Jitter;
use idem_diesel::diesel_async::{AsyncConnection, AsyncPgConnection, TransactionManager};
use idem_diesel::{AsyncSqliteConnection, Event, PgOutbox, Publish, PublishError, SqliteOutbox};
use idem_rabbitmq::OutboxPublisher;
use idem_rabbitmq::lapin::{Connection, ConnectionProperties};
use idem_rabbitmq::{
    Attempt, Backoff, Consumer, ConsumerPolicy, Error, Handler, HandlerError, HandlerFuture, Inbox,
    MemoryInbox, Message, Publisher, QueueType, Topology,
};
use idem_testkit::wait::until;
use idem_testkit::{TestPostgres, TestRabbitMq};
use libtest_mimic::{Arguments, Failed, Trial};
use serde::{Deserialize, Serialize};
use tokio::sync::{Barrier, oneshot, watch};
use tokio::task::JoinHandle;

type Outcome = Result<String, Failed>;

/// A case: its name (its queue's too), whether it must run alone, and how to
/// run it (the figure behind a pass).
struct Scenario {
    name: &'static str,
    alone: bool,
    run: fn(Case) -> BoxFuture<'static, Outcome>,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "duplicates_are_applied_once",
        alone: false,
        run: |case| duplicates_are_applied_once(case).boxed(),
    },
    Scenario {
        name: "a_failing_message_is_dead_lettered_after_exactly_three_attempts",
        alone: false,
        run: |case| dead_lettered_after_three_attempts(case, QueueType::Classic).boxed(),
    },
    Scenario {
        name: "on_quorum_queues_a_failing_message_is_dead_lettered_after_exactly_three_attempts",
        alone: false,
        run: |case| dead_lettered_after_three_attempts(case, QueueType::Quorum).boxed(),
    },
    Scenario {
        name: "a_short_retry_is_not_held_behind_a_long_one",
        alone: false,
        run: |case| a_short_retry_is_not_held_behind_a_long_one(case).boxed(),
    },
    Scenario {
        name: "one_alert_per_crossing_of_the_threshold",
        alone: false,
        run: |case| one_alert_per_crossing_of_the_threshold(case).boxed(),
    },
    Scenario {
        name: "a_redrive_is_applied_once",
        alone: false,
        run: |case| a_redrive_is_applied_once(case).boxed(),
    },
    Scenario {
        name: "the_consumer_resumes_by_itself_after_a_broker_restart",
        alone: true,
        run: |case| the_consumer_resumes_after_a_broker_restart(case).boxed(),
    },
    Scenario {
        name: "a_graceful_shutdown_under_load_loses_nothing",
        alone: false,
        run: |case| a_graceful_shutdown_under_load_loses_nothing(case).boxed(),
    },
    Scenario {
        name: "no_log_line_carries_a_message_id_a_body_or_the_password",
        alone: false,
        run: |case| no_log_line_carries_a_message_id_a_body_or_the_password(case).boxed(),
    },
    Scenario {
        name: "concurrency_n_runs_n_handlers_at_once",
        alone: false,
        run: |case| concurrency_n_runs_n_handlers_at_once(case).boxed(),
    },
    Scenario {
        name: "outbox_two_relays_on_postgres_publish_committed_events_once_in_order_per_key",
        alone: false,
        run: |case| outbox_two_relays_on_postgres(case).boxed(),
    },
    Scenario {
        name: "outbox_a_relay_dropped_mid_batch_republishes_with_the_same_ids_applied_once",
        alone: false,
        run: |case| outbox_a_relay_dropped_mid_batch(case).boxed(),
    },
    Scenario {
        name: "outbox_an_event_the_broker_refuses_is_parked_and_blocks_no_other_key",
        alone: false,
        run: |case| outbox_an_event_the_broker_refuses_is_parked(case).boxed(),
    },
    Scenario {
        name: "outbox_a_full_queue_that_refuses_publishes_is_waited_out_never_parked",
        alone: false,
        run: |case| outbox_a_full_queue_is_waited_out(case).boxed(),
    },
    Scenario {
        name: "a_consumer_on_an_inbox_nobody_migrated_does_not_start",
        alone: false,
        run: |case| a_consumer_on_an_unverified_inbox_does_not_start(case).boxed(),
    },
];

fn main() -> ExitCode {
    let args = Arguments::from_args();
    // Every event of this crate and of the protocol, at every level, for
    // the case that reads them. (lapin's own TRACE events show every frame,
    // bodies included: an application keeps `lapin` at DEBUG or above.)
    let logs = Captured::default();
    let _ = LOGS.set(logs.clone());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "idem=trace,idem_rabbitmq=trace",
        ))
        .with_writer(logs)
        .with_ansi(false)
        .init();
    let broker: Arc<OnceLock<Result<TestRabbitMq, String>>> = Arc::new(OnceLock::new());
    let alone = Arc::new(RwLock::new(()));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => Arc::new(runtime),
        Err(error) => {
            eprintln!("cannot start a Tokio runtime for the tests: {error}");
            return ExitCode::FAILURE;
        }
    };
    let trials = SCENARIOS
        .iter()
        .map(|scenario| {
            let broker = broker.clone();
            let runtime = runtime.clone();
            let alone = alone.clone();
            Trial::test(scenario.name, move || {
                let node = broker
                    .get_or_init(|| TestRabbitMq::start().map_err(|e| format!("RabbitMQ: {e}")))
                    .as_ref()
                    .map_err(|why| Failed::from(why.as_str()))?;
                let _turn = if scenario.alone {
                    Turn::Alone(alone.write().unwrap_or_else(|p| p.into_inner()))
                } else {
                    Turn::Shared(alone.read().unwrap_or_else(|p| p.into_inner()))
                };
                let case = Case {
                    url: node.url(),
                    queue: scenario.name.to_owned(),
                    broker: broker.clone(),
                };
                runtime
                    .block_on((scenario.run)(case))
                    .map(|figure| println!("{}: {figure}", scenario.name))
                    .map_err(|failed| {
                        Failed::from(format!(
                            "{}\n(the node's logs: {})",
                            failed.message().unwrap_or_default(),
                            node.dir().join("log").display()
                        ))
                    })
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    drop(runtime);
    // The node is stopped here, whatever the trials did.
    drop(broker);
    conclusion.exit_code()
}

/// What the log events wrote.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

static LOGS: OnceLock<Captured> = OnceLock::new();

impl Captured {
    fn text() -> String {
        LOGS.get()
            .map(|logs| String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned())
            .unwrap_or_default()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[allow(dead_code)]
enum Turn<'a> {
    Alone(std::sync::RwLockWriteGuard<'a, ()>),
    Shared(std::sync::RwLockReadGuard<'a, ()>),
}

struct Case {
    url: String,
    queue: String,
    broker: Arc<OnceLock<Result<TestRabbitMq, String>>>,
}

impl Case {
    fn broker(&self) -> &TestRabbitMq {
        match self.broker.get() {
            Some(Ok(broker)) => broker,
            _ => unreachable!("the node started before the case"),
        }
    }

    fn dlq(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// A consumer of the case's queue on `inbox`, applying `apply`.
    fn consumer(
        &self,
        inbox: MemoryInbox,
        apply: Apply,
        policy: ConsumerPolicy,
        concurrency: usize,
    ) -> Result<Consumer<MemoryInbox, Apply>, Failed> {
        Consumer::builder(&self.url, &self.queue)
            .inbox(inbox)
            .handler(apply)
            .policy(policy)
            .concurrency(concurrency)
            .build()
            .map_err(failed)
    }

    /// Publishes each `(id, payment)` once, confirmed.
    async fn publish(&self, payments: &[(String, Payment)]) -> Result<(), Failed> {
        let publisher = Publisher::connect(&self.url).await.map_err(failed)?;
        for (id, payment) in payments {
            publisher
                .publish(&self.queue, &payment.message(id))
                .await
                .map_err(failed)?;
        }
        publisher.close().await;
        Ok(())
    }

    /// How many messages are ready in `queue` (0 when it does not exist).
    async fn ready(&self, queue: &str) -> Result<u32, String> {
        let connection = Connection::connect(&self.url, ConnectionProperties::default())
            .await
            .map_err(|e| e.to_string())?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())?;
        let ready = match idem_rabbitmq::ready(&channel, queue).await {
            Ok(ready) => Ok(ready),
            Err(Error::NoSuchQueue(_)) => Ok(0),
            Err(error) => Err(error.to_string()),
        };
        let _ = connection.close(200, "counted".into()).await;
        ready
    }

    /// Waits until `queue` holds exactly `count` ready messages.
    async fn await_ready(&self, queue: &str, count: u32, limit: Duration) -> Result<(), Failed> {
        until(format!("{queue} holds {count} messages"), limit, || async {
            match self.ready(queue).await {
                Ok(ready) if ready == count => Ok(()),
                Ok(ready) => Err(format!("{ready} ready")),
                Err(error) => Err(error),
            }
        })
        .await
        .map_err(Failed::from)
    }

    /// The queue's unacknowledged messages, as the broker counts them.
    fn unacknowledged(&self, queue: &str) -> Result<u64, Failed> {
        let listed = self
            .broker()
            .ctl(&["list_queues", "-q", "name", "messages_unacknowledged"])
            .map_err(failed)?;
        Ok(listed
            .lines()
            .filter_map(|line| line.split_once('\t'))
            .find(|(name, _)| *name == queue)
            .and_then(|(_, count)| count.trim().parse().ok())
            .unwrap_or(0))
    }
}

/// A payment: add `amount` to the account's balance.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Payment {
    account_id: String,
    amount: i64,
}

impl Payment {
    fn new(account: &str, amount: i64) -> Self {
        Self {
            account_id: account.to_owned(),
            amount,
        }
    }

    fn message(&self, id: &str) -> Message {
        Message::new(serde_json::to_vec(self).unwrap()).id(id)
    }
}

/// `count` payments `prefix-i` over 7 accounts, amounts 1 to `count`.
fn payments(prefix: &str, count: usize) -> Vec<(String, Payment)> {
    (0..count)
        .map(|i| {
            (
                format!("{prefix}-{i}"),
                Payment::new(&format!("acc-{}", i % 7), i as i64 + 1),
            )
        })
        .collect()
}

/// Every account's balance and operations after applying `payments` once.
fn balances(payments: &[(String, Payment)]) -> HashMap<String, (i64, u64)> {
    let mut balances: HashMap<String, (i64, u64)> = HashMap::new();
    for (_, payment) in payments {
        let account = balances.entry(payment.account_id.clone()).or_default();
        account.0 += payment.amount;
        account.1 += 1;
    }
    balances
}

/// The effect: balances, and how many times each message was applied.
#[derive(Clone, Default)]
struct Ledger {
    inner: Arc<Mutex<LedgerState>>,
}

#[derive(Default)]
struct LedgerState {
    balances: HashMap<String, (i64, u64)>,
    applied: HashMap<String, u64>,
}

impl Ledger {
    fn apply(&self, id: &str, payment: &Payment) {
        let mut state = self.inner.lock().unwrap();
        let account = state
            .balances
            .entry(payment.account_id.clone())
            .or_default();
        account.0 += payment.amount;
        account.1 += 1;
        *state.applied.entry(id.to_owned()).or_default() += 1;
    }

    fn operations(&self) -> u64 {
        self.inner.lock().unwrap().applied.values().sum()
    }

    fn balances(&self) -> HashMap<String, (i64, u64)> {
        self.inner.lock().unwrap().balances.clone()
    }

    /// Fails unless every payment was applied exactly once.
    fn exact(&self, payments: &[(String, Payment)]) -> Result<(), Failed> {
        let state = self.inner.lock().unwrap();
        let twice: Vec<_> = state.applied.iter().filter(|(_, n)| **n != 1).collect();
        ensure(
            twice.is_empty(),
            format!("applied more than once: {twice:?}"),
        )?;
        ensure(
            state.applied.len() == payments.len(),
            format!(
                "{} of {} messages applied",
                state.applied.len(),
                payments.len()
            ),
        )?;
        ensure(
            state.balances == balances(payments),
            format!(
                "balances {:?}, expected {:?}",
                state.balances,
                balances(payments)
            ),
        )
    }
}

/// One run of the handler, as it saw it.
#[derive(Clone, Debug)]
struct Seen {
    id: String,
    attempt: u32,
    at: Instant,
    delivery_count: Option<u32>,
}

type Fails = dyn Fn(&str, u32) -> Option<HandlerError> + Send + Sync;

/// The handler: applies the payment to the ledger, unless `fails` says
/// otherwise for this message and attempt; records each run; optionally
/// takes `latency` and waits at a gate.
#[derive(Clone)]
struct Apply {
    ledger: Ledger,
    fails: Arc<Fails>,
    latency: Duration,
    gate: Option<Arc<Barrier>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    in_flight: Arc<AtomicUsize>,
    most_in_flight: Arc<AtomicUsize>,
}

impl Apply {
    fn new(ledger: &Ledger) -> Self {
        Self {
            ledger: ledger.clone(),
            fails: Arc::new(|_, _| None),
            latency: Duration::ZERO,
            gate: None,
            seen: Arc::default(),
            in_flight: Arc::default(),
            most_in_flight: Arc::default(),
        }
    }

    fn failing(
        mut self,
        fails: impl Fn(&str, u32) -> Option<HandlerError> + Send + Sync + 'static,
    ) -> Self {
        self.fails = Arc::new(fails);
        self
    }

    fn latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    fn gate(mut self, gate: Arc<Barrier>) -> Self {
        self.gate = Some(gate);
        self
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn runs_of(&self, id: &str) -> Vec<Seen> {
        self.seen().into_iter().filter(|s| s.id == id).collect()
    }
}

impl Handler<()> for Apply {
    fn handle<'a>(&'a self, attempt: Attempt<'a>, _tx: &'a mut ()) -> HandlerFuture<'a> {
        Box::pin(async move {
            let id = attempt.key();
            self.seen.lock().unwrap().push(Seen {
                id: id.to_owned(),
                attempt: attempt.number(),
                at: Instant::now(),
                delivery_count: attempt.broker_delivery_count(),
            });
            let payment: Payment = attempt.json().map_err(HandlerError::permanent)?;
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_in_flight.fetch_max(now, Ordering::SeqCst);
            let ran = async {
                if let Some(gate) = &self.gate {
                    tokio::time::timeout(Duration::from_secs(20), gate.wait())
                        .await
                        .map_err(|_| HandlerError::permanent("the gate never filled"))?;
                }
                if !self.latency.is_zero() {
                    // The effect's own duration, not a wait for readiness.
                    tokio::time::sleep(self.latency).await;
                }
                if let Some(error) = (self.fails)(id, attempt.number()) {
                    return Err(error);
                }
                self.ledger.apply(id, &payment);
                Ok(())
            }
            .await;
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            ran
        })
    }
}

/// A consumer running in a task, stopped on demand.
struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), Error>>,
    subscriptions: watch::Receiver<u64>,
}

impl Running {
    /// Runs `consumer` and waits until it subscribed.
    async fn start<I: Inbox>(consumer: Arc<Consumer<I, Apply>>) -> Result<Self, Failed>
    where
        Apply: Handler<I::Tx>,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let (subscribed, subscriptions) = watch::channel(0u64);
        let task = tokio::spawn(async move {
            consumer
                .run(
                    async {
                        let _ = stopped.await;
                    },
                    move |s| {
                        let _ = subscribed.send(s.subscription);
                    },
                )
                .await
        });
        let mut running = Self {
            stop: Some(stop),
            task,
            subscriptions,
        };
        running.subscribed(1).await?;
        Ok(running)
    }

    /// Waits until the consumer subscribed `n` times.
    async fn subscribed(&mut self, n: u64) -> Result<(), Failed> {
        let waited = tokio::time::timeout(
            Duration::from_secs(60),
            self.subscriptions.wait_for(|count| *count >= n),
        )
        .await
        .map(|seen| seen.map(drop));
        match waited {
            Ok(Ok(())) => Ok(()),
            _ if self.task.is_finished() => Err(Failed::from(format!(
                "the consumer ended before its subscription {n}: {:?}",
                (&mut self.task).await
            ))),
            _ => Err(Failed::from(format!(
                "the consumer did not subscribe {n} times within 60 s (it did {} times)",
                *self.subscriptions.borrow()
            ))),
        }
    }

    /// Shuts the consumer down gracefully; answers how long it took.
    async fn stop(mut self) -> Result<Duration, Failed> {
        let started = Instant::now();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match tokio::time::timeout(Duration::from_secs(60), self.task).await {
            Ok(Ok(Ok(()))) => Ok(started.elapsed()),
            Ok(Ok(Err(error))) => Err(failed(error)),
            Ok(Err(error)) => Err(failed(error)),
            Err(_) => Err(Failed::from("the consumer did not stop within 60 s")),
        }
    }
}

fn ensure(condition: bool, why: impl Display) -> Result<(), Failed> {
    if condition {
        Ok(())
    } else {
        Err(Failed::from(why.to_string()))
    }
}

fn failed(error: impl Display) -> Failed {
    Failed::from(error.to_string())
}

/// A policy with quick retries.
fn quick(max_attempts: u32) -> ConsumerPolicy {
    ConsumerPolicy::new()
        .max_attempts(max_attempts)
        .backoff(Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(200),
        ))
}

async fn operations(ledger: &Ledger, count: u64, limit: Duration) -> Result<(), Failed> {
    until(format!("{count} operations"), limit, || async {
        let done = ledger.operations();
        if done >= count {
            Ok(())
        } else {
            Err(format!("{done} operations"))
        }
    })
    .await
    .map_err(Failed::from)
}

// --- the cases ---

/// 500 messages, 100 of them published twice (a producer that retried):
/// every balance exact, each message applied once, nothing left.
async fn duplicates_are_applied_once(case: Case) -> Outcome {
    let unique = payments("m", 500);
    let mut published = unique.clone();
    published.extend(unique.iter().step_by(5).cloned());
    ensure(published.len() == 600, "600 publishes")?;

    let ledger = Ledger::default();
    let consumer = case.consumer(MemoryInbox::new(), Apply::new(&ledger), quick(3), 4)?;
    let running = Running::start(Arc::new(consumer)).await?;
    case.publish(&published).await?;
    operations(&ledger, 500, Duration::from_secs(60)).await?;
    case.await_ready(&case.queue, 0, Duration::from_secs(30))
        .await?;
    running.stop().await?;
    // What was delivered and not acknowledged is back in the queue now.
    ensure(
        case.ready(&case.queue).await? == 0,
        "every delivery, the duplicates included, was acknowledged",
    )?;
    ledger.exact(&unique)?;
    Ok(format!(
        "600 deliveries of 500 messages: 500 operations, {} accounts exact",
        ledger.balances().len()
    ))
}

/// A message that fails every time: in the dead-letter queue after exactly
/// three attempts, with the reason, the three attempts' times and its
/// `x-death` history; the listing leaves it there.
async fn dead_lettered_after_three_attempts(case: Case, queue_type: QueueType) -> Outcome {
    let ledger = Ledger::default();
    let apply =
        Apply::new(&ledger).failing(|_, _| Some(HandlerError::transient("the ledger is down")));
    let consumer = Consumer::builder(&case.url, &case.queue)
        .inbox(MemoryInbox::new())
        .handler(apply.clone())
        .policy(quick(3))
        .queue_type(queue_type)
        .build()
        .map_err(failed)?;
    let consumer = Arc::new(consumer);
    let running = Running::start(consumer.clone()).await?;
    case.publish(&[("poison-1".to_owned(), Payment::new("acc-1", 5))])
        .await?;
    case.await_ready(&case.dlq(), 1, Duration::from_secs(30))
        .await?;
    running.stop().await?;

    let runs = apply.runs_of("poison-1");
    let attempts: Vec<u32> = runs.iter().map(|s| s.attempt).collect();
    ensure(attempts == [1, 2, 3], format!("attempts {attempts:?}"))?;
    if queue_type == QueueType::Quorum {
        let counts: Vec<_> = runs.iter().map(|s| s.delivery_count).collect();
        ensure(
            counts == [Some(1); 3],
            format!("each attempt is a first delivery of its copy: {counts:?}"),
        )?;
    }
    let letters = idem_rabbitmq::dead_letters(&case.url, &case.queue)
        .await
        .map_err(failed)?;
    let [letter] = letters.as_slice() else {
        return Err(failed(format!("one dead letter, got {letters:?}")));
    };
    ensure(
        letter.message_id.as_deref() == Some("poison-1") && letter.queue == case.queue,
        format!("{letter:?}"),
    )?;
    ensure(
        letter.reason.contains("the ledger is down"),
        format!("reason {:?}", letter.reason),
    )?;
    ensure(
        letter.attempted_at.len() == 3 && letter.attempted_at.is_sorted(),
        format!("three attempt times: {:?}", letter.attempted_at),
    )?;
    let hop = format!("{}.dlq.hop", case.queue);
    ensure(
        letter
            .deaths
            .iter()
            .any(|d| d.queue == hop && d.reason == "expired"),
        format!("x-death records the hop: {:?}", letter.deaths),
    )?;
    let retried: u64 = letter
        .deaths
        .iter()
        .filter(|d| d.queue.starts_with(&format!("{}.retry.", case.queue)))
        .map(|d| d.count)
        .sum();
    ensure(
        retried == 2,
        format!("x-death records the two retries: {:?}", letter.deaths),
    )?;
    ensure(
        serde_json::from_slice::<Payment>(&letter.body).is_ok(),
        "the body is the message's",
    )?;
    case.await_ready(&case.dlq(), 1, Duration::from_secs(5))
        .await?;
    let recorded = consumer.protocol().dead_letters().await.map_err(failed)?;
    ensure(
        recorded.len() == 1 && recorded[0].published && recorded[0].attempts == 3,
        format!("the inbox's record: {recorded:?}"),
    )?;
    ensure(ledger.operations() == 0, "never applied")?;
    Ok(format!(
        "3 attempts over {:?}, then the dead-letter queue ({} x-death entries)",
        runs[2].at - runs[0].at,
        letter.deaths.len()
    ))
}

/// A retry of 200 ms is not held behind one of 3.2 s: each comes back
/// after its own delay (RabbitMQ expires per-message TTLs only at a queue's
/// head; each power of two of milliseconds has its delay queue).
async fn a_short_retry_is_not_held_behind_a_long_one(case: Case) -> Outcome {
    let ledger = Ledger::default();
    let apply = Apply::new(&ledger).failing(|id, attempt| {
        let fails = match id {
            "long" => attempt <= 5,
            _ => attempt == 1,
        };
        fails.then(|| HandlerError::transient("not yet"))
    });
    // Delays without jitter: 200, 400, 800, 1600, then 3200 ms.
    let policy = ConsumerPolicy::new().max_attempts(10).backoff(
        Backoff::new(Duration::from_millis(200), Duration::from_millis(3200)).jitter(Jitter::None),
    );
    let consumer = case.consumer(MemoryInbox::new(), apply.clone(), policy, 2)?;
    let running = Running::start(Arc::new(consumer)).await?;
    case.publish(&[("long".to_owned(), Payment::new("acc-1", 1))])
        .await?;
    // "long" waits 3.2 s in its delay queue; then "short" fails once.
    let long_queue = format!("{}.retry.4096ms", case.queue);
    case.await_ready(&long_queue, 1, Duration::from_secs(30))
        .await?;
    case.publish(&[("short".to_owned(), Payment::new("acc-2", 1))])
        .await?;
    operations(&ledger, 2, Duration::from_secs(30)).await?;
    running.stop().await?;

    let (long, short) = (apply.runs_of("long"), apply.runs_of("short"));
    ensure(
        long.len() == 6 && short.len() == 2,
        format!("runs: long {long:?}, short {short:?}"),
    )?;
    let short_wait = short[1].at - short[0].at;
    let long_wait = long[5].at - long[4].at;
    ensure(
        short_wait < Duration::from_millis(2000),
        format!("the 200 ms retry came back after {short_wait:?}"),
    )?;
    ensure(
        long_wait >= Duration::from_millis(3200),
        format!("the 3.2 s retry came back after {long_wait:?}"),
    )?;
    ensure(short[1].at < long[5].at, "the short retry came back first")?;
    Ok(format!(
        "the 200 ms retry came back after {short_wait:?}, while the 3.2 s one (queued first) took {long_wait:?}"
    ))
}

/// Past a threshold of 2, the third dead letter alerts, the fourth and fifth
/// do not; after three are re-driven and applied (two left), the next one
/// crosses again and alerts again.
async fn one_alert_per_crossing_of_the_threshold(case: Case) -> Outcome {
    let ledger = Ledger::default();
    let broken = Arc::new(AtomicBool::new(true));
    let flag = broken.clone();
    let apply = Apply::new(&ledger).failing(move |_, _| {
        flag.load(Ordering::SeqCst)
            .then(|| HandlerError::permanent("the account is closed"))
    });
    let alerts = Arc::new(Mutex::new(Vec::new()));
    let raised = alerts.clone();
    let policy = quick(3).dead_letter_alert(2, move |alert| {
        raised.lock().unwrap().push(alert.dead_letters);
    });
    let consumer = Arc::new(case.consumer(MemoryInbox::new(), apply, policy, 1)?);
    let running = Running::start(consumer.clone()).await?;
    let letters = payments("d", 6);
    case.publish(&letters[..5]).await?;
    case.await_ready(&case.dlq(), 5, Duration::from_secs(30))
        .await?;
    let raised = alerts.lock().unwrap().clone();
    ensure(
        raised == [3],
        format!("five dead letters, one alert: {raised:?}"),
    )?;

    broken.store(false, Ordering::SeqCst);
    for (id, _) in &letters[..3] {
        let moved = idem_rabbitmq::redrive_message(&case.url, &case.queue, id)
            .await
            .map_err(failed)?;
        ensure(moved == 1, format!("{id}: {moved} moved"))?;
    }
    operations(&ledger, 3, Duration::from_secs(30)).await?;
    let left = consumer.protocol().dead_letters().await.map_err(failed)?;
    ensure(left.len() == 2, format!("two dead letters left: {left:?}"))?;

    broken.store(true, Ordering::SeqCst);
    case.publish(&letters[5..]).await?;
    case.await_ready(&case.dlq(), 3, Duration::from_secs(30))
        .await?;
    running.stop().await?;
    let raised = alerts.lock().unwrap().clone();
    ensure(
        raised == [3, 3],
        format!("a second crossing, a second alert: {raised:?}"),
    )?;
    let kept: Vec<_> = idem_rabbitmq::dead_letters(&case.url, &case.queue)
        .await
        .map_err(failed)?
        .into_iter()
        .filter_map(|letter| letter.message_id)
        .collect();
    ensure(
        kept == ["d-3", "d-4", "d-5"],
        format!("the others stayed, in order: {kept:?}"),
    )?;
    Ok("6 dead letters over a threshold of 2, 3 re-driven between: 2 alerts".to_owned())
}

/// A dead letter re-driven after the fix is applied once: a second redrive
/// moves nothing, and the producer sending it again is a duplicate.
async fn a_redrive_is_applied_once(case: Case) -> Outcome {
    let ledger = Ledger::default();
    let broken = Arc::new(AtomicBool::new(true));
    let flag = broken.clone();
    let apply = Apply::new(&ledger).failing(move |_, _| {
        flag.load(Ordering::SeqCst)
            .then(|| HandlerError::transient("a bug"))
    });
    let consumer = Arc::new(case.consumer(MemoryInbox::new(), apply.clone(), quick(3), 1)?);
    let running = Running::start(consumer.clone()).await?;
    let message = [("r-1".to_owned(), Payment::new("acc-1", 5))];
    case.publish(&message).await?;
    case.await_ready(&case.dlq(), 1, Duration::from_secs(30))
        .await?;

    broken.store(false, Ordering::SeqCst);
    let moved = idem_rabbitmq::redrive(&case.url, &case.queue)
        .await
        .map_err(failed)?;
    ensure(moved == 1, format!("{moved} re-driven"))?;
    operations(&ledger, 1, Duration::from_secs(30)).await?;
    let again = idem_rabbitmq::redrive(&case.url, &case.queue)
        .await
        .map_err(failed)?;
    ensure(again == 0, format!("a second redrive moved {again}"))?;
    case.publish(&message).await?;
    case.await_ready(&case.queue, 0, Duration::from_secs(30))
        .await?;
    running.stop().await?;
    ensure(
        case.ready(&case.queue).await? == 0 && case.ready(&case.dlq()).await? == 0,
        "nothing left in the queue or the dead-letter queue",
    )?;
    ledger.exact(&message)?;
    let attempts: Vec<u32> = apply.runs_of("r-1").iter().map(|s| s.attempt).collect();
    ensure(
        attempts == [1, 2, 3, 1],
        format!("three failed attempts, then attempt 1 again: {attempts:?}"),
    )?;
    ensure(
        consumer
            .protocol()
            .dead_letters()
            .await
            .map_err(failed)?
            .is_empty(),
        "the inbox forgot the dead letter",
    )?;
    Ok("dead-lettered, re-driven, applied once; the resend was a duplicate".to_owned())
}

/// The broker stopped and started while 500 messages flow: the consumer
/// reconnects by itself and every balance is exact.
async fn the_consumer_resumes_after_a_broker_restart(case: Case) -> Outcome {
    let unique = payments("b", 500);
    let ledger = Ledger::default();
    let apply = Apply::new(&ledger).latency(Duration::from_millis(2));
    let consumer = Arc::new(
        Consumer::builder(&case.url, &case.queue)
            .inbox(MemoryInbox::new())
            .handler(apply)
            .policy(quick(3))
            .concurrency(4)
            .broker_backoff(Backoff::new(
                Duration::from_millis(100),
                Duration::from_secs(1),
            ))
            .build()
            .map_err(failed)?,
    );
    let mut running = Running::start(consumer).await?;

    // A producer that retries each message, under its id, until confirmed.
    let url = case.url.clone();
    let queue = case.queue.clone();
    let sent = unique.clone();
    let retried = Arc::new(AtomicU64::new(0));
    let retries = retried.clone();
    let producer = tokio::spawn(async move {
        let mut publisher = None;
        for (id, payment) in &sent {
            let started = Instant::now();
            loop {
                if publisher.is_none() {
                    publisher = Publisher::connect(&url).await.ok();
                }
                if let Some(open) = &publisher
                    && open.publish(&queue, &payment.message(id)).await.is_ok()
                {
                    break;
                }
                retries.fetch_add(1, Ordering::Relaxed);
                if started.elapsed() > Duration::from_secs(60) {
                    return Err(format!("{id} not confirmed within 60 s"));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // A steady producer: the restart comes while it publishes.
            tokio::time::sleep(Duration::from_millis(4)).await;
        }
        Ok(())
    });

    operations(&ledger, 150, Duration::from_secs(60)).await?;
    let broker = case.broker();
    let stopped_at = ledger.operations();
    // The case runs on the trial's thread (`block_on`): blocking it holds
    // up no consumer task.
    broker.stop_app().map_err(failed)?;
    // The broker stays down a moment while the producer and the consumer
    // fail (the scenario's outage, not a wait for readiness).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let restarted = Instant::now();
    broker.start_app().map_err(failed)?;
    running.subscribed(2).await?;
    let resumed = restarted.elapsed();

    match tokio::time::timeout(Duration::from_secs(120), producer).await {
        Ok(Ok(Ok(()))) => {}
        other => return Err(failed(format!("the producer: {other:?}"))),
    }
    operations(&ledger, 500, Duration::from_secs(120)).await?;
    case.await_ready(&case.queue, 0, Duration::from_secs(30))
        .await?;
    running.stop().await?;
    ensure(
        case.ready(&case.queue).await? == 0,
        "every delivery was acknowledged",
    )?;
    ledger.exact(&unique)?;
    Ok(format!(
        "stopped at {stopped_at} operations; resubscribed {resumed:?} after `start_app` began; {} publishes retried; 500 applied once",
        retried.load(Ordering::Relaxed)
    ))
}

/// Shut down while 4 handlers run: what committed was acknowledged, what did
/// not is back in the queue, and a second consumer finishes with every
/// balance exact. The 300 messages are in the queue (declared as the
/// consumer declares it) before the consumer starts: published while it
/// ran, on a loaded machine, they were all applied (4 at a time, 20 ms
/// each) before the publisher had its last confirm, and the shutdown came
/// under no load.
async fn a_graceful_shutdown_under_load_loses_nothing(case: Case) -> Outcome {
    let unique = payments("g", 300);
    let connection = Connection::connect(&case.url, ConnectionProperties::default())
        .await
        .map_err(failed)?;
    let channel = connection.create_channel().await.map_err(failed)?;
    Topology::new(case.queue.as_str())
        .declare(&channel)
        .await
        .map_err(failed)?;
    let _ = connection.close(200, "bye".into()).await;
    case.publish(&unique).await?;
    let ledger = Ledger::default();
    let inbox = MemoryInbox::new();
    let apply = Apply::new(&ledger).latency(Duration::from_millis(20));
    let consumer = Consumer::builder(&case.url, &case.queue)
        .inbox(inbox.clone())
        .handler(apply.clone())
        .policy(quick(3))
        .concurrency(4)
        .prefetch(16)
        .build()
        .map_err(failed)?;
    let running = Running::start(Arc::new(consumer)).await?;
    operations(&ledger, 60, Duration::from_secs(60)).await?;
    let took = running.stop().await?;

    let applied = ledger.operations();
    let left = case.ready(&case.queue).await?;
    ensure(
        applied + u64::from(left) == 300,
        format!("{applied} applied + {left} left in the queue ≠ 300"),
    )?;
    ensure(
        case.unacknowledged(&case.queue)? == 0,
        "nothing unacknowledged",
    )?;
    ensure(
        applied < 300,
        "the shutdown came under load (some messages not yet applied)",
    )?;

    let consumer = case.consumer(inbox, apply, quick(3), 4)?;
    let running = Running::start(Arc::new(consumer)).await?;
    operations(&ledger, 300, Duration::from_secs(60)).await?;
    case.await_ready(&case.queue, 0, Duration::from_secs(30))
        .await?;
    running.stop().await?;
    ledger.exact(&unique)?;
    Ok(format!(
        "stopped in {took:?} with {applied} applied and {left} back in the queue; the next consumer finished: 300 exact"
    ))
}

/// With concurrency 4 (and a prefetch of 8), four handlers run at once,
/// never more: each waits at a gate that opens when four are there.
async fn concurrency_n_runs_n_handlers_at_once(case: Case) -> Outcome {
    let ledger = Ledger::default();
    let apply = Apply::new(&ledger).gate(Arc::new(Barrier::new(4)));
    let consumer = Consumer::builder(&case.url, &case.queue)
        .inbox(MemoryInbox::new())
        .handler(apply.clone())
        .policy(quick(1))
        .concurrency(4)
        .prefetch(8)
        .build()
        .map_err(failed)?;
    let running = Running::start(Arc::new(consumer)).await?;
    let messages = payments("c", 16);
    case.publish(&messages).await?;
    operations(&ledger, 16, Duration::from_secs(60)).await?;
    running.stop().await?;
    ledger.exact(&messages)?;
    let most = apply.most_in_flight.load(Ordering::SeqCst);
    ensure(most == 4, format!("at most {most} handlers ran at once"))?;
    Ok("16 messages through a gate of 4: 4 handlers at once, never more".to_owned())
}

/// At TRACE, through a retry, a dead letter, a listing, a redrive, a
/// publish and a connection refused: no event carries a whole message id,
/// a body or the AMQP URL's password (a user of its own, with a password
/// found nowhere else).
async fn no_log_line_carries_a_message_id_a_body_or_the_password(case: Case) -> Outcome {
    const PASSWORD: &str = "pw-9f3c1e77d2b4";
    let broker = case.broker();
    broker
        .ctl(&["add_user", "idem-logs", PASSWORD])
        .map_err(failed)?;
    broker
        .ctl(&["set_permissions", "-p", "/", "idem-logs", ".*", ".*", ".*"])
        .map_err(failed)?;
    let port = broker.port();
    let url = format!("amqp://idem-logs:{PASSWORD}@127.0.0.1:{port}/%2f");
    let case = Case { url, ..case };

    let ids = [
        "message-id-secret-0c9a5e31-1",
        "message-id-secret-0c9a5e31-2",
    ];
    let bodies = [
        Payment::new("acc-secret-body-7d1e-1", 3),
        Payment::new("acc-secret-body-7d1e-2", 4),
    ];
    let ledger = Ledger::default();
    let broken = Arc::new(AtomicBool::new(true));
    let flag = broken.clone();
    let apply = Apply::new(&ledger).failing(move |id, attempt| {
        if id.ends_with("-1") && flag.load(Ordering::SeqCst) {
            Some(HandlerError::permanent("the account is closed"))
        } else if id.ends_with("-2") && attempt == 1 {
            Some(HandlerError::transient("try again"))
        } else {
            None
        }
    });
    let consumer = Arc::new(case.consumer(MemoryInbox::new(), apply, quick(3), 1)?);
    let running = Running::start(consumer).await?;
    let messages: Vec<(String, Payment)> = ids
        .iter()
        .map(|id| (*id).to_owned())
        .zip(bodies.iter().cloned())
        .collect();
    case.publish(&messages).await?;
    case.await_ready(&case.dlq(), 1, Duration::from_secs(30))
        .await?;
    operations(&ledger, 1, Duration::from_secs(30)).await?;
    let listed = idem_rabbitmq::dead_letters(&case.url, &case.queue)
        .await
        .map_err(failed)?;
    let shown = format!("{listed:?}");
    broken.store(false, Ordering::SeqCst);
    idem_rabbitmq::redrive_message(&case.url, &case.queue, ids[0])
        .await
        .map_err(failed)?;
    operations(&ledger, 2, Duration::from_secs(30)).await?;
    running.stop().await?;

    // A broker that refuses the connection: the consumer logs its retries.
    let nowhere = format!("amqp://idem-logs:{PASSWORD}@127.0.0.1:1/%2f");
    let refused = Publisher::connect(&nowhere)
        .await
        .err()
        .map(|error| format!("{error} {error:?}"))
        .unwrap_or_default();
    let lost = Consumer::builder(&nowhere, &case.queue)
        .inbox(MemoryInbox::new())
        .handler(Apply::new(&ledger))
        .build()
        .map_err(failed)?;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        lost.run(
            async {
                let _ = stopped.await;
            },
            |_| {},
        )
        .await
    });
    until("a reconnection logged", Duration::from_secs(30), || async {
        if Captured::text().contains("127.0.0.1:1/") {
            Ok(())
        } else {
            Err("none yet".to_owned())
        }
    })
    .await?;
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(30), task).await;

    let logs = Captured::text();
    if std::env::var_os("IDEM_SHOW_LOGS").is_some() {
        eprintln!("{logs}");
    }
    let secrets = [ids[0], ids[1], "acc-secret-body-7d1e", PASSWORD];
    for secret in secrets {
        ensure(
            !logs.contains(secret),
            format!("a log line carries {secret:?}"),
        )?;
        ensure(
            !shown.contains(secret) || secret.starts_with("message-id"),
            format!("a dead letter's Debug shows {secret:?}"),
        )?;
        ensure(
            !refused.contains(secret),
            format!("a connection error shows {secret:?}: {refused}"),
        )?;
    }
    ensure(
        !shown.contains(ids[0]),
        format!("a dead letter's Debug shows its id: {shown}"),
    )?;
    ensure(
        logs.contains("dead letter re-driven") && logs.contains("idem.message"),
        "the events were captured",
    )?;
    Ok(format!(
        "{} bytes of TRACE events: no message id, body or password",
        logs.len()
    ))
}

// --- the outbox's relay, end to end ---

/// `count` payments over `accounts` accounts, as events to `queue`: the
/// amounts of each account count up from 1, so that order shows.
fn payment_events(
    queue: &str,
    prefix: &str,
    count: usize,
    accounts: usize,
) -> Vec<(Event, Payment)> {
    (0..count)
        .map(|i| {
            let payment = Payment::new(
                &format!("{prefix}-{}", i % accounts),
                (i / accounts) as i64 + 1,
            );
            let event = Event::new(
                queue,
                payment.account_id.clone(),
                serde_json::to_vec(&payment).unwrap(),
            )
            .header("content-type", "application/json");
            (event, payment)
        })
        .collect()
}

/// The events as the ledger should see them: keyed by their ids.
fn by_id(events: &[(Event, Payment)]) -> Vec<(String, Payment)> {
    events
        .iter()
        .map(|(event, payment)| (event.id().to_string(), payment.clone()))
        .collect()
}

/// A fresh PostgreSQL database with the outbox's table.
async fn postgres_outbox() -> Result<PgOutbox, Failed> {
    let url = tokio::task::spawn_blocking(|| {
        let cluster = TestPostgres::shared().map_err(failed)?;
        let name = cluster.fresh_database("outbox").map_err(failed)?;
        Ok::<_, Failed>(cluster.url(&name))
    })
    .await
    .map_err(failed)??;
    let outbox = PgOutbox::connect(&url).await.map_err(failed)?;
    outbox.migrate().await.map_err(failed)?;
    Ok(outbox)
}

/// Stages each event in a transaction of its own, committed or rolled back.
async fn stage_on_postgres(
    outbox: &PgOutbox,
    events: &[Event],
    commit: bool,
) -> Result<(), Failed> {
    type Manager = <AsyncPgConnection as AsyncConnection>::TransactionManager;
    let mut pooled = outbox.pool().get().await.map_err(failed)?;
    let connection: &mut AsyncPgConnection = &mut pooled;
    for event in events {
        Manager::begin_transaction(connection)
            .await
            .map_err(failed)?;
        outbox.stage(connection, event).await.map_err(failed)?;
        if commit {
            Manager::commit_transaction(connection)
                .await
                .map_err(failed)?;
        } else {
            Manager::rollback_transaction(connection)
                .await
                .map_err(failed)?;
        }
    }
    Ok(())
}

async fn stage_on_sqlite(outbox: &SqliteOutbox, events: &[Event]) -> Result<(), Failed> {
    type Manager = <AsyncSqliteConnection as AsyncConnection>::TransactionManager;
    let mut pooled = outbox.pool().get().await.map_err(failed)?;
    let connection: &mut AsyncSqliteConnection = &mut pooled;
    Manager::begin_transaction(connection)
        .await
        .map_err(failed)?;
    for event in events {
        outbox.stage(connection, event).await.map_err(failed)?;
    }
    Manager::commit_transaction(connection)
        .await
        .map_err(failed)
}

/// Fails unless each account's payments were applied with their amounts
/// counting up: in the order they were staged.
fn in_order_per_account(apply: &Apply, events: &[(Event, Payment)]) -> Result<(), Failed> {
    let amounts: HashMap<String, &Payment> = events
        .iter()
        .map(|(event, payment)| (event.id().to_string(), payment))
        .collect();
    let mut next: HashMap<&str, i64> = HashMap::new();
    for seen in apply.seen() {
        let payment = amounts
            .get(&seen.id)
            .ok_or_else(|| Failed::from(format!("an unknown message ran: {}", seen.id)))?;
        let expected = next.entry(&payment.account_id).or_insert(1);
        ensure(
            payment.amount == *expected,
            format!(
                "{} got amount {} when {} was due",
                payment.account_id, payment.amount, expected
            ),
        )?;
        *expected += 1;
    }
    Ok(())
}

async fn stop_relays(
    stop: watch::Sender<bool>,
    relays: Vec<JoinHandle<idem_diesel::Relayed>>,
) -> Result<Vec<u64>, Failed> {
    let _ = stop.send(true);
    let mut published = Vec::new();
    for relay in relays {
        published.push(relay.await.map_err(failed)?.published);
    }
    Ok(published)
}

fn spawn_relay<P: Publish>(
    relay: idem_diesel::Relay<P>,
    stop: &watch::Sender<bool>,
) -> JoinHandle<idem_diesel::Relayed> {
    let mut stopped = stop.subscribe();
    tokio::spawn(relay.run(async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    }))
}

/// 90 events over 3 accounts, each committed in its own transaction (and 5
/// rolled back), published by two relays at once on PostgreSQL: the
/// consumer (concurrency 1, so it applies in queue order) applies each
/// committed event once under its id as `message_id`, each account's in the
/// order staged, and never a rolled-back one.
async fn outbox_two_relays_on_postgres(case: Case) -> Outcome {
    let outbox = postgres_outbox().await?;
    let ledger = Ledger::default();
    let apply = Apply::new(&ledger);
    let consumer = case.consumer(MemoryInbox::new(), apply.clone(), quick(3), 1)?;
    let running = Running::start(Arc::new(consumer)).await?;

    let events = payment_events(&case.queue, "acc", 90, 3);
    let rolled_back = payment_events(&case.queue, "rolled", 5, 1);
    let (stop, _) = watch::channel(false);
    let mut relays = Vec::new();
    for _ in 0..2 {
        let publisher = OutboxPublisher::connect(&case.url).await.map_err(failed)?;
        relays.push(spawn_relay(
            outbox
                .relay(publisher)
                .expect("migrated")
                .batch_size(8)
                .poll_interval(Duration::from_millis(200)),
            &stop,
        ));
    }
    let staged: Vec<Event> = events.iter().map(|(event, _)| event.clone()).collect();
    for chunk in staged.chunks(10) {
        stage_on_postgres(&outbox, chunk, true).await?;
        stage_on_postgres(&outbox, &[rolled_back[0].0.clone()], false).await?;
    }
    operations(&ledger, 90, Duration::from_secs(60)).await?;
    until("the outbox drained", Duration::from_secs(30), || async {
        match outbox.backlog().await {
            Ok(backlog) if backlog.unsent == 0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    let published = stop_relays(stop, relays).await?;
    case.await_ready(&case.queue, 0, Duration::from_secs(30))
        .await?;
    running.stop().await?;
    ledger.exact(&by_id(&events))?;
    in_order_per_account(&apply, &events)?;
    ensure(
        published.iter().sum::<u64>() == 90,
        format!("the relays published {published:?}"),
    )?;
    Ok(format!(
        "90 committed events, 9 rolled back: relays published {published:?}, each applied once, in order per account"
    ))
}

/// A publisher that stops answering after `limit` confirmed publishes: a
/// relay that hangs mid-batch, then is dropped (a crash).
struct Hanging {
    inner: OutboxPublisher,
    limit: usize,
    started: AtomicUsize,
    done: Arc<AtomicUsize>,
}

impl Publish for Hanging {
    fn publish<'a>(
        &'a self,
        event: &'a Event,
    ) -> idem_diesel::idem_core::outbox::PublishFuture<'a> {
        Box::pin(async move {
            if self.started.fetch_add(1, Ordering::SeqCst) >= self.limit {
                std::future::pending::<()>().await;
            }
            self.inner.publish(event).await?;
            self.done.fetch_add(1, Ordering::SeqCst);
            Ok::<(), PublishError>(())
        })
    }
}

/// On SQLite, a relay publishes 4 of 12 events and is dropped before it marks
/// any sent; the next relay publishes all 12, the first 4 again under the
/// same `message_id`s: the consumer's inbox applies each event once.
async fn outbox_a_relay_dropped_mid_batch(case: Case) -> Outcome {
    let dir = std::env::temp_dir().join(format!("idem-rabbitmq-outbox-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(failed)?;
    let path = dir.join(format!("{}.db", case.queue));
    let _ = std::fs::remove_file(&path);
    let outbox = SqliteOutbox::connect(&format!("sqlite://{}", path.display()))
        .await
        .map_err(failed)?;
    outbox.migrate().await.map_err(failed)?;
    let ledger = Ledger::default();
    let apply = Apply::new(&ledger);
    let consumer = case.consumer(MemoryInbox::new(), apply.clone(), quick(3), 2)?;
    let running = Running::start(Arc::new(consumer)).await?;

    let events = payment_events(&case.queue, "crash", 12, 4);
    let staged: Vec<Event> = events.iter().map(|(event, _)| event.clone()).collect();
    stage_on_sqlite(&outbox, &staged).await?;
    let done = Arc::new(AtomicUsize::new(0));
    let hanging = Hanging {
        inner: OutboxPublisher::connect(&case.url).await.map_err(failed)?,
        limit: 4,
        started: AtomicUsize::new(0),
        done: done.clone(),
    };
    let crashed = tokio::spawn(
        outbox
            .relay(hanging)
            .expect("migrated")
            .batch_size(20)
            .run(std::future::pending()),
    );
    until(
        "4 publishes before the crash",
        Duration::from_secs(30),
        || async {
            match done.load(Ordering::SeqCst) {
                4 => Ok(()),
                n => Err(format!("{n} published")),
            }
        },
    )
    .await?;
    crashed.abort();
    let _ = crashed.await;
    ensure(
        outbox.backlog().await.map_err(failed)?.unsent == 12,
        "the crashed relay marked nothing sent",
    )?;

    let (stop, _) = watch::channel(false);
    let publisher = OutboxPublisher::connect(&case.url).await.map_err(failed)?;
    let relay = spawn_relay(outbox.relay(publisher).expect("migrated"), &stop);
    operations(&ledger, 12, Duration::from_secs(60)).await?;
    until("the outbox drained", Duration::from_secs(30), || async {
        match outbox.backlog().await {
            Ok(backlog) if backlog.unsent == 0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    let published = stop_relays(stop, vec![relay]).await?;
    case.await_ready(&case.queue, 0, Duration::from_secs(30))
        .await?;
    running.stop().await?;
    ledger.exact(&by_id(&events))?;
    ensure(
        published == [12],
        format!("the second relay published {published:?}"),
    )?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok("16 publishes of 12 events (4 twice, same ids): 12 operations".to_owned())
}

/// The broker refuses an event over its `max_message_size` (1 MiB here):
/// the relay parks it with the broker's reason, and the events behind it, of
/// its key and of another, are published.
async fn outbox_an_event_the_broker_refuses_is_parked(case: Case) -> Outcome {
    let set_limit = |bytes: u64| {
        case.broker()
            .ctl(&[
                "eval",
                &format!("application:set_env(rabbit, max_message_size, {bytes})."),
            ])
            .map_err(failed)
    };
    set_limit(1024 * 1024)?;
    let outcome = async {
        let outbox = postgres_outbox().await?;
        let ledger = Ledger::default();
        let consumer = case.consumer(MemoryInbox::new(), Apply::new(&ledger), quick(3), 1)?;
        let running = Running::start(Arc::new(consumer)).await?;
        let huge = Event::new(&case.queue, "acc-big", vec![b'x'; 2 * 1024 * 1024]);
        let after = payment_events(&case.queue, "acc", 4, 2);
        let mut staged = vec![huge.clone()];
        staged.extend(after.iter().map(|(event, _)| event.clone()));
        stage_on_postgres(&outbox, &staged, true).await?;
        let publisher = OutboxPublisher::connect(&case.url).await.map_err(failed)?;
        let relay = outbox.relay(publisher).expect("migrated");
        until("the outbox drained", Duration::from_secs(30), || async {
            let _ = relay.run_once().await;
            match outbox.backlog().await {
                Ok(backlog) if backlog.unsent == 0 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await?;
        operations(&ledger, 4, Duration::from_secs(30)).await?;
        running.stop().await?;
        ledger.exact(&by_id(&after))?;
        let parked = outbox.parked().await.map_err(failed)?;
        ensure(
            parked.len() == 1 && parked[0].id == huge.id(),
            format!("parked: {parked:?}"),
        )?;
        ensure(relay.report().parked == 1, "one parked, counted")?;
        Ok::<_, Failed>(format!("parked: {}", parked[0].reason))
    }
    .await;
    // RabbitMQ 3.10's default.
    set_limit(134_217_728)?;
    outcome
}

/// A queue capped at 3 messages with `overflow: reject-publish` refuses
/// (`basic.nack`) every publish while full: 12 events for it are retried,
/// never parked, and, drained 3 at a time by a reader, all arrive, each
/// once, in order per key.
async fn outbox_a_full_queue_is_waited_out(case: Case) -> Outcome {
    use idem_rabbitmq::lapin::options::{BasicGetOptions, QueueDeclareOptions};
    use idem_rabbitmq::lapin::types::{AMQPValue, FieldTable};
    let capped = format!("{}-capped", case.queue);
    let connection = Connection::connect(&case.url, ConnectionProperties::default())
        .await
        .map_err(failed)?;
    let channel = connection.create_channel().await.map_err(failed)?;
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongInt(3));
    arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    channel
        .queue_declare(
            capped.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await
        .map_err(failed)?;
    let outbox = postgres_outbox().await?;
    let events = payment_events(&capped, "acc", 12, 3);
    let staged: Vec<Event> = events.iter().map(|(event, _)| event.clone()).collect();
    stage_on_postgres(&outbox, &staged, true).await?;
    let publisher = OutboxPublisher::connect(&case.url).await.map_err(failed)?;
    let relay = outbox.relay(publisher).expect("migrated");
    let mut received: Vec<String> = Vec::new();
    let mut refused_while_full = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let _ = relay.run_once().await;
        let backlog = outbox.backlog().await.map_err(failed)?;
        // The queue is full (3) while events wait: the broker refuses them.
        if idem_rabbitmq::ready(&channel, &capped)
            .await
            .map_err(failed)?
            == 3
            && backlog.unsent > 0
        {
            refused_while_full = true;
        }
        if backlog.unsent == 0 && received.len() >= 12 {
            break;
        }
        ensure(
            Instant::now() < deadline,
            format!(
                "not every event through the capped queue after 60 s: unsent {}, received {}",
                backlog.unsent,
                received.len()
            ),
        )?;
        // The reader takes what is there.
        while let Some(message) = channel
            .basic_get(capped.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .map_err(failed)?
        {
            let id = message
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .unwrap_or_default();
            received.push(id);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let expected: Vec<String> = staged.iter().map(|e| e.id().to_string()).collect();
    let mut sorted = received.clone();
    sorted.sort();
    let mut want = expected.clone();
    want.sort();
    ensure(
        sorted == want,
        format!("received {received:?}, expected each of {expected:?} once"),
    )?;
    // In order per key: each account's events arrive in the order staged.
    for account in ["acc-0", "acc-1", "acc-2"] {
        let order = |ids: &[String]| -> Vec<String> {
            ids.iter()
                .filter(|id| {
                    staged
                        .iter()
                        .any(|e| e.id().to_string() == **id && e.key() == account)
                })
                .cloned()
                .collect()
        };
        ensure(
            order(&received) == order(&expected),
            format!("{account}: out of order"),
        )?;
    }
    let parked = outbox.parked().await.map_err(failed)?;
    ensure(
        parked.is_empty() && relay.report().parked == 0,
        format!("parked: {parked:?}"),
    )?;
    ensure(
        refused_while_full,
        "the queue was never full while events waited",
    )?;
    let _ = connection.close(0, "done".into()).await;
    Ok("12 events through a queue capped at 3 (reject-publish): all received once, in order per key, 0 parked".to_owned())
}

/// A consumer whose SQLite inbox was neither migrated nor checked in this
/// process: `run` answers `Error::NotReady`, naming the fix, before it
/// connects; once the inbox is migrated the same consumer subscribes.
async fn a_consumer_on_an_unverified_inbox_does_not_start(case: Case) -> Outcome {
    let dir = std::env::temp_dir().join(format!("idem-rabbitmq-inbox-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(failed)?;
    let path = dir.join(format!("{}.db", case.queue));
    let _ = std::fs::remove_file(&path);
    let inbox = idem_diesel::SqliteInbox::connect(&format!("sqlite://{}", path.display()))
        .await
        .map_err(failed)?;
    let nothing = idem_core::consume::handler(
        |_: Attempt<'_>, _: &mut AsyncSqliteConnection| -> HandlerFuture<'_> {
            Box::pin(async { Ok(()) })
        },
    );
    let consumer = Consumer::builder(&case.url, &case.queue)
        .inbox(inbox.clone())
        .handler(nothing)
        .build()
        .map_err(failed)?;
    let refused = consumer.run(std::future::pending(), |_| {}).await;
    let Err(Error::NotReady(not_ready)) = refused else {
        return Err(failed(format!("expected NotReady, got {refused:?}")));
    };
    ensure(
        not_ready.0.starts_with("the consumer inbox's tables (idem_consumer_inbox, idem_consumer_failures, idem_consumer_dead_letters) were not verified before a consumer started on it: call `inbox.migrate().await` at start-up"),
        format!("the refusal: {not_ready}"),
    )?;
    inbox.migrate().await.map_err(failed)?;
    let (on_subscribed, subscribed) = oneshot::channel();
    let mut on_subscribed = Some(on_subscribed);
    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        consumer
            .run(
                async move {
                    let _ = stopped.await;
                },
                move |_| {
                    if let Some(on_subscribed) = on_subscribed.take() {
                        let _ = on_subscribed.send(());
                    }
                },
            )
            .await
    });
    tokio::time::timeout(Duration::from_secs(30), subscribed)
        .await
        .map_err(|_| failed("the migrated inbox's consumer did not subscribe in 30 s"))?
        .map_err(failed)?;
    let _ = stop.send(());
    running.await.map_err(failed)?.map_err(failed)?;
    Ok("refused, then subscribed once migrated".to_owned())
}
