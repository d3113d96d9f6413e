//! idem-sqs against a real local SQS: one moto server for the binary
//! (stopped when the trials end), a queue per case, `MemoryInbox` as the
//! inbox and an in-memory ledger as the effect.
//!
//! Every wait is bounded and fails loudly with what it waited for and what
//! it last saw; none waits for readiness by sleeping.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::future::Future;
use std::net::Ipv4Addr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use idem_sqs::aws_sdk_sqs::Client;
use idem_sqs::aws_sdk_sqs::types::QueueAttributeName;
use idem_sqs::{
    Attempt, Backoff, BatchHandler, ClientConfig, Consumer, ConsumerPolicy, Deduplication, Handler,
    HandlerError, HandlerFuture, MemoryInbox, Outgoing, Publisher,
};
use idem_testkit::TestSqs;
use idem_testkit::fault::{Fault, Proxy};
use idem_testkit::wait::until;
use libtest_mimic::{Arguments, Failed, Trial};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

type Outcome = Result<String, Failed>;
type Run = fn(Case) -> std::pin::Pin<Box<dyn Future<Output = Outcome> + Send>>;

const SCENARIOS: &[(&str, Run)] = &[
    ("each_message_is_applied_once_with_duplicates", |c| {
        Box::pin(each_message_is_applied_once_with_duplicates(c))
    }),
    (
        "a_handler_slower_than_the_visibility_timeout_runs_once",
        |c| Box::pin(a_handler_slower_than_the_visibility_timeout_runs_once(c)),
    ),
    ("a_silent_link_holds_no_call_for_good", |c| {
        Box::pin(a_silent_link_holds_no_call_for_good(c))
    }),
    ("a_batch_lease_holds_over_a_link_of_50_ms_each_way", |c| {
        Box::pin(a_batch_lease_holds_over_a_slow_link(c))
    }),
    (
        "a_failing_message_is_dead_lettered_after_exactly_three_receives",
        |c| Box::pin(a_failing_message_is_dead_lettered_after_exactly_three_receives(c)),
    ),
    ("the_redrive_policy_target_is_the_dead_letter_queue", |c| {
        Box::pin(the_redrive_policy_target_is_the_dead_letter_queue(c))
    }),
    ("a_redrive_is_applied_once", |c| {
        Box::pin(a_redrive_is_applied_once(c))
    }),
    (
        "fifo_groups_keep_their_order_and_a_failing_group_blocks_only_itself",
        |c| Box::pin(fifo_groups_keep_their_order(c)),
    ),
    (
        "fifo_content_deduplication_and_the_inbox_after_the_window",
        |c| Box::pin(fifo_content_deduplication_exercise(c)),
    ),
];

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let logs = Captured::default();
    let _ = LOGS.set(logs.clone());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "idem=trace,idem_sqs=trace",
        ))
        .with_writer(logs)
        .with_ansi(false)
        .init();
    let server: Arc<OnceLock<Result<TestSqs, String>>> = Arc::new(OnceLock::new());
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
        .map(|&(name, run)| {
            let server = server.clone();
            let runtime = runtime.clone();
            Trial::test(name, move || {
                let sqs = server
                    .get_or_init(|| TestSqs::start().map_err(|e| format!("moto: {e}")))
                    .as_ref()
                    .map_err(|why| Failed::from(why.as_str()))?;
                let client = local(sqs.port()).build().map_err(failed)?;
                let case = Case {
                    client,
                    name: sqs.fresh_name(&name[..name.len().min(40)]),
                    port: sqs.port(),
                };
                runtime
                    .block_on(run(case))
                    .map(|figure| println!("{name}: {figure}"))
                    .map_err(|failed| {
                        Failed::from(format!(
                            "{}\n--- moto's log ---\n{}",
                            failed.message().unwrap_or_default(),
                            sqs.log()
                        ))
                    })
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    drop(runtime);
    // The server is stopped here, whatever the trials did.
    drop(server);
    conclusion.exit_code()
}

/// A client's settings for the SQS on 127.0.0.1's `port` (moto, or a proxy
/// to it), which takes any credentials.
fn local(port: u16) -> ClientConfig {
    ClientConfig::from_env()
        .endpoint(format!("http://127.0.0.1:{port}"))
        .region("us-east-1")
        .credentials("test", "test")
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

fn failed(error: impl std::fmt::Display) -> Failed {
    Failed::from(error.to_string())
}

/// A case: the client, a queue name of its own, and moto's port.
struct Case {
    client: Client,
    name: String,
    port: u16,
}

impl Case {
    /// Creates the queue `name` with `attributes`; answers its URL.
    async fn create(
        &self,
        name: &str,
        attributes: &[(QueueAttributeName, &str)],
    ) -> Result<String, Failed> {
        let mut create = self.client.create_queue().queue_name(name);
        for (attribute, value) in attributes {
            create = create.attributes(attribute.clone(), *value);
        }
        let created = create
            .send()
            .await
            .map_err(|e| failed(format!("create {name}: {e:?}")))?;
        Ok(created.queue_url().unwrap_or_default().to_owned())
    }

    /// The case's standard queue, with `visibility` seconds of visibility
    /// timeout.
    async fn standard(&self, visibility: &str) -> Result<String, Failed> {
        self.create(
            &self.name,
            &[(QueueAttributeName::VisibilityTimeout, visibility)],
        )
        .await
    }

    /// A consumer of `url`, started; stopped by the answer's sender.
    fn start(
        &self,
        url: &str,
        inbox: MemoryInbox,
        apply: Apply,
        policy: ConsumerPolicy,
        concurrency: usize,
    ) -> Result<Running, Failed> {
        Self::start_on(
            self.client.clone(),
            url,
            inbox,
            apply,
            policy,
            concurrency,
            None,
        )
    }

    /// [`start`](Self::start), the consumer on `client`; with `batch`, it
    /// applies the messages of a receive (up to `batch`) together.
    fn start_on(
        client: Client,
        url: &str,
        inbox: MemoryInbox,
        apply: Apply,
        policy: ConsumerPolicy,
        concurrency: usize,
        batch: Option<usize>,
    ) -> Result<Running, Failed> {
        let builder = Consumer::builder(client, url)
            .inbox(inbox)
            .policy(policy)
            .concurrency(concurrency)
            .wait_time(Duration::from_secs(1))
            .shutdown_timeout(Duration::from_secs(10));
        match batch {
            None => builder.handler(apply).build().map(Self::running),
            Some(size) => builder
                .batch_size(size)
                .batch_handler(apply, size)
                .build()
                .map(Self::running),
        }
        .map_err(failed)
    }

    /// Runs `consumer` in a task of its own.
    fn running<H: Handler<()> + 'static>(consumer: Consumer<MemoryInbox, H>) -> Running {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            consumer
                .run(
                    async move {
                        let _ = stopped.await;
                    },
                    |_| {},
                )
                .await
                .map_err(|e| e.to_string())
        });
        Running { stop, task }
    }

    /// Sends `(message_id, payment)` pairs to the standard queue `url`.
    async fn send(&self, url: &str, payments: &[(String, Payment)]) -> Result<(), Failed> {
        let publisher = Publisher::new(self.client.clone(), url).map_err(failed)?;
        for (id, payment) in payments {
            publisher
                .send(&Outgoing::new(payment.body()).message_id(id))
                .await
                .map_err(failed)?;
        }
        Ok(())
    }

    /// Visible plus in-flight messages of `url`.
    async fn depth(&self, url: &str) -> Result<u64, String> {
        let answer = self
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|e| format!("{e:?}"))?;
        let attributes = answer.attributes().cloned().unwrap_or_default();
        let count = |name| {
            attributes
                .get(&name)
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0)
        };
        Ok(count(QueueAttributeName::ApproximateNumberOfMessages)
            + count(QueueAttributeName::ApproximateNumberOfMessagesNotVisible))
    }

    /// The URL of the queue `name`.
    async fn url_of(&self, name: &str) -> Result<String, String> {
        self.client
            .get_queue_url()
            .queue_name(name)
            .send()
            .await
            .map(|answer| answer.queue_url().unwrap_or_default().to_owned())
            .map_err(|e| format!("{e:?}"))
    }

    /// Waits until the queue `name` exists and holds `count` messages.
    async fn await_depth(&self, name: &str, count: u64, limit: Duration) -> Result<(), Failed> {
        until(format!("{name} holds {count} messages"), limit, || async {
            let url = self.url_of(name).await?;
            match self.depth(&url).await? {
                depth if depth == count => Ok(()),
                depth => Err(format!("{depth} messages")),
            }
        })
        .await
        .map_err(Failed::from)
    }
}

/// A consumer running in its task.
struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), String>>,
}

impl Running {
    async fn stop(self) -> Result<(), Failed> {
        let _ = self.stop.send(());
        match tokio::time::timeout(Duration::from_secs(30), self.task).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(error))) => Err(failed(format!("the consumer failed: {error}"))),
            Ok(Err(error)) => Err(failed(format!("the consumer's task failed: {error}"))),
            Err(_) => Err(failed("the consumer did not stop within 30 s")),
        }
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

    fn body(&self) -> String {
        serde_json::to_string(self).unwrap()
    }
}

/// What the handler saw and did.
#[derive(Default)]
struct Ledger {
    balances: HashMap<String, i64>,
    /// Each run: the key, the account, the amount, the attempt, SQS's
    /// receive count, when it ended.
    runs: Vec<Run_>,
}

#[derive(Clone, Debug)]
#[allow(dead_code)]
struct Run_ {
    key: String,
    account: String,
    amount: i64,
    attempt: u32,
    receive_count: Option<u32>,
    applied: bool,
    at: Instant,
}

/// The handler: applies a payment to the in-memory ledger, failing while
/// `failing` names its account, after waiting `latency`.
#[derive(Clone)]
struct Apply {
    ledger: Arc<Mutex<Ledger>>,
    failing: Arc<Mutex<Option<String>>>,
    latency: Duration,
    running: Arc<AtomicUsize>,
}

impl Apply {
    fn new() -> Self {
        Self {
            ledger: Arc::default(),
            failing: Arc::default(),
            latency: Duration::ZERO,
            running: Arc::default(),
        }
    }

    fn fail(&self, account: Option<&str>) {
        *self.failing.lock().unwrap() = account.map(str::to_owned);
    }

    fn runs(&self) -> Vec<Run_> {
        self.ledger.lock().unwrap().runs.clone()
    }

    fn applied(&self) -> Vec<Run_> {
        self.runs().into_iter().filter(|r| r.applied).collect()
    }

    fn balance(&self, account: &str) -> i64 {
        self.ledger
            .lock()
            .unwrap()
            .balances
            .get(account)
            .copied()
            .unwrap_or(0)
    }
}

impl Apply {
    /// Records `attempt`'s run, and applies it unless its account fails.
    fn record(&self, attempt: &Attempt<'_>) -> Result<(), HandlerError> {
        let payment: Payment = attempt.json().map_err(HandlerError::permanent)?;
        let failing = self.failing.lock().unwrap().clone();
        let applied = failing.as_deref() != Some(payment.account_id.as_str());
        let mut ledger = self.ledger.lock().unwrap();
        ledger.runs.push(Run_ {
            key: attempt.key().to_owned(),
            account: payment.account_id.clone(),
            amount: payment.amount,
            attempt: attempt.number(),
            receive_count: attempt.broker_delivery_count(),
            applied,
            at: Instant::now(),
        });
        if !applied {
            return Err(HandlerError::transient("the account's ledger is down"));
        }
        *ledger.balances.entry(payment.account_id).or_insert(0) += payment.amount;
        Ok(())
    }

    /// Waits the handler's latency, counted in `running` meanwhile.
    async fn wait(&self) {
        self.running.fetch_add(1, Ordering::SeqCst);
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        self.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Handler<()> for Apply {
    fn handle<'a>(&'a self, attempt: Attempt<'a>, _tx: &'a mut ()) -> HandlerFuture<'a> {
        Box::pin(async move {
            attempt.json::<Payment>().map_err(HandlerError::permanent)?;
            self.wait().await;
            self.record(&attempt)
        })
    }
}

/// A batch waits the latency once, then each message is recorded.
impl BatchHandler<()> for Apply {
    fn handle<'a>(&'a self, batch: &'a [Attempt<'a>], _tx: &'a mut ()) -> HandlerFuture<'a> {
        Box::pin(async move {
            self.wait().await;
            batch.iter().try_for_each(|attempt| self.record(attempt))
        })
    }
}

fn policy(max_attempts: u32) -> ConsumerPolicy {
    ConsumerPolicy::new()
        .max_attempts(max_attempts)
        .backoff(Backoff::new(
            Duration::from_millis(500),
            Duration::from_secs(2),
        ))
        .unavailable_pause(Duration::from_millis(200))
}

fn check(condition: bool, what: impl FnOnce() -> String) -> Result<(), Failed> {
    if condition {
        Ok(())
    } else {
        Err(failed(what()))
    }
}

/// 40 payments over 4 accounts, 10 of them sent twice (a producer's
/// retries), 4 handlers at once: each applied once, exact balances.
async fn each_message_is_applied_once_with_duplicates(case: Case) -> Outcome {
    let url = case.standard("30").await?;
    let mut payments = Vec::new();
    let mut expected: HashMap<String, i64> = HashMap::new();
    for i in 0..40 {
        let account = format!("acc-{}", i % 4);
        let amount = i64::from(i + 1);
        *expected.entry(account.clone()).or_default() += amount;
        payments.push((
            format!("pay-{}-{i}", case.name),
            Payment::new(&account, amount),
        ));
    }
    let duplicates: Vec<_> = payments.iter().step_by(4).cloned().collect();
    case.send(&url, &payments).await?;
    case.send(&url, &duplicates).await?;
    let apply = Apply::new();
    let running = case.start(&url, MemoryInbox::new(), apply.clone(), policy(3), 4)?;
    until(
        "40 payments applied and the queue empty".to_owned(),
        Duration::from_secs(60),
        || async {
            let applied = apply.applied().len();
            let depth = case.depth(&url).await?;
            if applied >= 40 && depth == 0 {
                Ok(())
            } else {
                Err(format!("{applied} applied, {depth} in the queue"))
            }
        },
    )
    .await?;
    running.stop().await?;
    let applied = apply.applied();
    let mut per_key: HashMap<&str, usize> = HashMap::new();
    for run in &applied {
        *per_key.entry(run.key.as_str()).or_default() += 1;
    }
    check(
        applied.len() == 40 && per_key.values().all(|&n| n == 1),
        || format!("{} applications over {} keys", applied.len(), per_key.len()),
    )?;
    for (account, amount) in &expected {
        check(apply.balance(account) == *amount, || {
            format!("{account}: {} instead of {amount}", apply.balance(account))
        })?;
    }
    let logs = Captured::text();
    let leaked = logs.lines().find(|line| {
        payments
            .iter()
            .any(|(id, payment)| line.contains(id.as_str()) || line.contains(&payment.body()))
    });
    check(leaked.is_none(), || {
        format!("a log line carries a message id or a body: {leaked:?}")
    })?;
    Ok(format!(
        "50 sent (10 duplicates), 40 applied once each, {} log lines without an id or a body",
        logs.lines().count()
    ))
}

/// A handler that takes 3 s on a queue whose visibility timeout is 1 s:
/// while it runs, another receiver sees nothing; it runs once and the
/// message is deleted.
async fn a_handler_slower_than_the_visibility_timeout_runs_once(case: Case) -> Outcome {
    let client = case.client.clone();
    a_slow_handler_runs_once(&case, client, 1, None, Duration::from_secs(3)).await
}

/// Ten messages taken by one receive for a batch handler, on a 1 s
/// visibility timeout, over a link of 50 ms each way: the batch takes 3 s
/// (`MemoryInbox` hands a batch's messages to the handler one after the
/// other, 300 ms each), and the ten leases are extended together, one call
/// a round, so none is visible to another receiver meanwhile. (Extended
/// one call a message, ten round trips of 100 ms and the quarter of the
/// lease between rounds outlast the lease.)
async fn a_batch_lease_holds_over_a_slow_link(case: Case) -> Outcome {
    let (_proxy, slow) = slow_link(&case, Duration::from_millis(50))?;
    let ran =
        a_slow_handler_runs_once(&case, slow, 10, Some(10), Duration::from_millis(300)).await?;
    Ok(format!("over a link of 50 ms each way, in batches: {ran}"))
}

/// The consumer's link to SQS drops every byte for 4 s (connections stay
/// open, nothing is answered) while messages wait: each call then in flight
/// is given up after its attempt timeout (3 s here) and tried again on
/// another connection, so once the link is back the consumer goes on by
/// itself, and every message is applied once. (Without the timeout, the
/// receive in flight waits for good.)
async fn a_silent_link_holds_no_call_for_good(case: Case) -> Outcome {
    // A receive whose answer the link dropped leaves its messages in flight
    // for the visibility timeout: 5 s.
    let url = case.standard("5").await?;
    let proxy = Proxy::tcp((Ipv4Addr::LOCALHOST, case.port).into()).map_err(failed)?;
    let client = local(proxy.port())
        .attempt_timeout(Duration::from_secs(3))
        .build()
        .map_err(failed)?;
    let apply = Apply::new();
    let running = Case::start_on(
        client,
        &url,
        MemoryInbox::new(),
        apply.clone(),
        policy(3),
        2,
        None,
    )?;
    let payments = |from: usize| -> Vec<(String, Payment)> {
        (from..from + 3)
            .map(|i| {
                (
                    format!("silent-{i}-{}", case.name),
                    Payment::new("acc-silent", 5),
                )
            })
            .collect()
    };
    let applied = |count: usize| {
        let apply = apply.clone();
        until(
            format!("{count} messages applied"),
            Duration::from_secs(60),
            move || {
                let applied = apply.applied().len();
                async move {
                    match applied >= count {
                        true => Ok(()),
                        false => Err(format!("{applied} applied")),
                    }
                }
            },
        )
    };
    case.send(&url, &payments(0)).await?;
    applied(3).await?;
    proxy.set(Fault::Blackhole);
    case.send(&url, &payments(3)).await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    proxy.set(Fault::None);
    let back = Instant::now();
    applied(6).await?;
    let took = back.elapsed();
    running.stop().await?;
    let runs = apply.applied();
    let keys: std::collections::HashSet<&str> = runs.iter().map(|run| run.key.as_str()).collect();
    check(runs.len() == 6 && keys.len() == 6, || {
        format!("{} applied runs of 6 messages: {runs:?}", runs.len())
    })?;
    check(apply.balance("acc-silent") == 30, || "balance".to_owned())?;
    Ok(format!(
        "6 messages, the link silent for 4 s: each applied once, the last 3 within {:.1} s of the link's return",
        took.as_secs_f64()
    ))
}

/// A proxy to moto that holds every chunk `latency` each way, and a client
/// through it.
fn slow_link(case: &Case, latency: Duration) -> Result<(Proxy, Client), Failed> {
    let proxy = Proxy::tcp((Ipv4Addr::LOCALHOST, case.port).into()).map_err(failed)?;
    proxy.set(Fault::Latency(latency));
    let client = local(proxy.port()).build().map_err(failed)?;
    Ok((proxy, client))
}

/// [`a_handler_slower_than_the_visibility_timeout_runs_once`] for
/// `messages` payments, its consumer on `consumer_client`, in batches of
/// `batch` if given, each call of the handler taking `latency`.
async fn a_slow_handler_runs_once(
    case: &Case,
    consumer_client: Client,
    messages: usize,
    batch: Option<usize>,
    latency: Duration,
) -> Outcome {
    let url = case.standard("1").await?;
    let payments: Vec<(String, Payment)> = (0..messages)
        .map(|i| {
            (
                format!("slow-{i}-{}", case.name),
                Payment::new("acc-slow", 7),
            )
        })
        .collect();
    case.send(&url, &payments).await?;
    let mut apply = Apply::new();
    apply.latency = latency;
    let started = Instant::now();
    let running = Case::start_on(
        consumer_client,
        &url,
        MemoryInbox::new(),
        apply.clone(),
        policy(3),
        2,
        batch,
    )?;
    until(
        "the slow handler started".to_owned(),
        Duration::from_secs(30),
        || async {
            if apply.running.load(Ordering::SeqCst) > 0 {
                Ok(())
            } else {
                Err("not yet".to_owned())
            }
        },
    )
    .await?;
    // Another receiver polls until the messages are deleted, past three
    // visibility timeouts; a message it got would prove its lease lapsed.
    let mut spied = 0u32;
    let mut seen = 0usize;
    while case.depth(&url).await.map_err(failed)? > 0 {
        check(started.elapsed() < Duration::from_secs(60), || {
            "the messages were not deleted within 60 s".to_owned()
        })?;
        let answer = case
            .client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(0)
            .send()
            .await
            .map_err(|e| failed(format!("{e:?}")))?;
        spied += 1;
        seen += answer.messages().len();
    }
    let took = started.elapsed();
    // Two more visibility timeouts with the consumer polling: nothing comes back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    running.stop().await?;
    let runs = apply.runs();
    check(seen == 0, || {
        format!("another receiver got {seen} messages while they were leased")
    })?;
    check(
        runs.len() == messages && runs.iter().all(|run| run.receive_count == Some(1)),
        || format!("{} runs of {messages} messages: {runs:?}", runs.len()),
    )?;
    let balance = apply.balance("acc-slow");
    check(balance == 7 * messages as i64, || {
        format!("balance {balance}")
    })?;
    Ok(format!(
        "{messages} message(s) on a 1 s visibility timeout, the handler {latency:?} a call: each ran once (receive count 1), {spied} receives by another receiver got nothing, deleted after {:.1} s",
        took.as_secs_f64()
    ))
}

/// A message whose handler always fails is in `<queue>-dlq` (created)
/// after exactly 3 receives, with its reason and 3 attempt times; the
/// listing keeps it.
async fn a_failing_message_is_dead_lettered_after_exactly_three_receives(case: Case) -> Outcome {
    let url = case.standard("30").await?;
    let apply = Apply::new();
    apply.fail(Some("acc-broken"));
    let id = format!("broken-{}", case.name);
    case.send(
        &url,
        &[
            (id.clone(), Payment::new("acc-broken", 5)),
            (format!("ok-{}", case.name), Payment::new("acc-ok", 3)),
        ],
    )
    .await?;
    let running = case.start(&url, MemoryInbox::new(), apply.clone(), policy(3), 2)?;
    let dlq = idem_sqs::dead_letter_queue_name(&case.name);
    case.await_depth(&dlq, 1, Duration::from_secs(60)).await?;
    until(
        "the work queue is empty".to_owned(),
        Duration::from_secs(30),
        || async {
            match case.depth(&url).await? {
                0 => Ok(()),
                depth => Err(format!("{depth} messages")),
            }
        },
    )
    .await?;
    running.stop().await?;
    let broken: Vec<Run_> = apply
        .runs()
        .into_iter()
        .filter(|r| r.account == "acc-broken")
        .collect();
    let counts: Vec<Option<u32>> = broken.iter().map(|r| r.receive_count).collect();
    check(counts == [Some(1), Some(2), Some(3)], || {
        format!("receive counts {counts:?}")
    })?;
    let letters = idem_sqs::dead_letters(&case.client, &url)
        .await
        .map_err(failed)?;
    check(letters.len() == 1, || format!("{letters:?}"))?;
    let letter = &letters[0];
    check(
        letter.message_id.as_deref() == Some(id.as_str())
            && letter.reason == "the account's ledger is down"
            && letter.attempted_at.len() == 3
            && letter.queue == case.name,
        || format!("{letter:?}"),
    )?;
    check(
        apply.balance("acc-ok") == 3 && apply.balance("acc-broken") == 0,
        || "balances".to_owned(),
    )?;
    // The listing removed nothing.
    case.await_depth(&dlq, 1, Duration::from_secs(10)).await?;
    Ok(format!(
        "dead letter after receives {counts:?}, reason and 3 attempt times in its attributes, still listed after a listing"
    ))
}

/// A queue with a redrive policy: the dead letter goes to its target, with
/// the reason, after exactly 2 attempts (the policy's maxReceiveCount 10 is
/// a backstop the consumer never reaches).
async fn the_redrive_policy_target_is_the_dead_letter_queue(case: Case) -> Outcome {
    let target_name = format!("{}-target", case.name);
    case.create(&target_name, &[]).await?;
    let policy_json = format!(
        r#"{{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:123456789012:{target_name}","maxReceiveCount":10}}"#
    );
    let url = case
        .create(
            &case.name,
            &[(QueueAttributeName::RedrivePolicy, policy_json.as_str())],
        )
        .await?;
    let apply = Apply::new();
    apply.fail(Some("acc-broken"));
    case.send(
        &url,
        &[(format!("r-{}", case.name), Payment::new("acc-broken", 1))],
    )
    .await?;
    let running = case.start(&url, MemoryInbox::new(), apply.clone(), policy(2), 1)?;
    case.await_depth(&target_name, 1, Duration::from_secs(60))
        .await?;
    running.stop().await?;
    let letters = idem_sqs::dead_letters(&case.client, &url)
        .await
        .map_err(failed)?;
    check(
        letters.len() == 1
            && letters[0].attempted_at.len() == 2
            && letters[0].reason == "the account's ledger is down",
        || format!("{letters:?}"),
    )?;
    let default_dlq = case
        .url_of(&idem_sqs::dead_letter_queue_name(&case.name))
        .await;
    check(default_dlq.is_err(), || {
        "a <queue>-dlq was created beside the redrive policy's target".to_owned()
    })?;
    Ok("the redrive policy's target holds the dead letter after 2 attempts, with its reason; no <queue>-dlq created".to_owned())
}

/// A dead letter, the cause fixed, re-driven: applied once; a second
/// redrive moves nothing.
async fn a_redrive_is_applied_once(case: Case) -> Outcome {
    let url = case.standard("30").await?;
    let apply = Apply::new();
    apply.fail(Some("acc-fixed"));
    let inbox = MemoryInbox::new();
    case.send(
        &url,
        &[(format!("fix-{}", case.name), Payment::new("acc-fixed", 11))],
    )
    .await?;
    let running = case.start(&url, inbox.clone(), apply.clone(), policy(2), 1)?;
    let dlq = idem_sqs::dead_letter_queue_name(&case.name);
    case.await_depth(&dlq, 1, Duration::from_secs(60)).await?;
    apply.fail(None);
    let moved = idem_sqs::redrive(&case.client, &url)
        .await
        .map_err(failed)?;
    check(moved == 1, || format!("{moved} moved"))?;
    until(
        "the re-driven payment applied".to_owned(),
        Duration::from_secs(30),
        || async {
            match apply.balance("acc-fixed") {
                11 => Ok(()),
                other => Err(format!("balance {other}")),
            }
        },
    )
    .await?;
    let again = idem_sqs::redrive(&case.client, &url)
        .await
        .map_err(failed)?;
    until(
        "the work queue is empty".to_owned(),
        Duration::from_secs(30),
        || async {
            match case.depth(&url).await? {
                0 => Ok(()),
                depth => Err(format!("{depth} messages")),
            }
        },
    )
    .await?;
    running.stop().await?;
    let applied = apply.applied();
    check(
        applied.len() == 1 && applied[0].attempt == 1 && again == 0,
        || format!("{applied:?}, a second redrive moved {again}"),
    )?;
    let letters = idem_sqs::dead_letters(&case.client, &url)
        .await
        .map_err(failed)?;
    check(letters.is_empty(), || format!("{letters:?}"))?;
    Ok("1 moved back, applied once from attempt 1, a second redrive moved 0".to_owned())
}

/// A FIFO queue, three groups of 5: each group applied in its order; the
/// head of group B fails until group A is all applied, and A is not held
/// behind it.
async fn fifo_groups_keep_their_order(case: Case) -> Outcome {
    let name = format!("{}.fifo", case.name);
    let url = case
        .create(
            &name,
            &[
                (QueueAttributeName::FifoQueue, "true"),
                (QueueAttributeName::VisibilityTimeout, "30"),
            ],
        )
        .await?;
    let publisher = Publisher::new(case.client.clone(), &url).map_err(failed)?;
    for i in 1..=5 {
        for group in ["A", "B", "C"] {
            let account = format!("acc-{group}");
            publisher
                .send(
                    &Outgoing::new(Payment::new(&account, i).body())
                        .message_id(format!("{group}-{i}-{}", case.name))
                        .group(group),
                )
                .await
                .map_err(failed)?;
        }
    }
    let apply = Apply::new();
    apply.fail(Some("acc-B"));
    let running = case.start(&url, MemoryInbox::new(), apply.clone(), policy(10), 4)?;
    until(
        "groups A and C applied while B's head fails".to_owned(),
        Duration::from_secs(60),
        || async {
            let applied = apply.applied();
            let done = |account: &str| applied.iter().filter(|r| r.account == account).count();
            if done("acc-A") == 5 && done("acc-C") == 5 {
                Ok(())
            } else {
                Err(format!("A {}, C {}", done("acc-A"), done("acc-C")))
            }
        },
    )
    .await?;
    let b_failures = apply.runs().iter().filter(|r| r.account == "acc-B").count();
    let b_applied_early = apply
        .applied()
        .iter()
        .filter(|r| r.account == "acc-B")
        .count();
    apply.fail(None);
    until(
        "group B applied".to_owned(),
        Duration::from_secs(60),
        || async {
            let done = apply
                .applied()
                .iter()
                .filter(|r| r.account == "acc-B")
                .count();
            if done == 5 {
                Ok(())
            } else {
                Err(format!("B {done}"))
            }
        },
    )
    .await?;
    running.stop().await?;
    let applied = apply.applied();
    for group in ["A", "B", "C"] {
        let amounts: Vec<i64> = applied
            .iter()
            .filter(|r| r.account == format!("acc-{group}"))
            .map(|r| r.amount)
            .collect();
        check(amounts == [1, 2, 3, 4, 5], || {
            format!("group {group} applied in the order {amounts:?}")
        })?;
    }
    let b_runs: Vec<i64> = apply
        .runs()
        .iter()
        .filter(|r| r.account == "acc-B")
        .map(|r| r.amount)
        .collect();
    check(
        b_applied_early == 0 && b_runs[..b_failures].iter().all(|&a| a == 1),
        || format!("group B ran {b_runs:?} while its head failed"),
    )?;
    Ok(format!(
        "3 groups of 5 applied in order; B's head failed {b_failures} times while A and C were applied, and nothing of B ran past it"
    ))
}

/// The exercise, on a FIFO queue with deduplication ids from the content's
/// SHA-256: 10 identical messages give 1 delivery and 1 effect; a field
/// changed gives 1 more; the first sent again after the window is
/// delivered again by the queue, and the inbox keeps its effect at one.
///
/// The window's end is simulated: moto forgets a deduplication id once its
/// message is deleted, so the same content sent after the consumer deleted
/// it is accepted and delivered again, which is what SQS does once the 5
/// minutes have passed. The same content is also sent once with another
/// deduplication id and the same `message_id` (a producer whose retry
/// changed its id): delivered by the queue, absorbed by the inbox.
async fn fifo_content_deduplication_exercise(case: Case) -> Outcome {
    let name = format!("{}.fifo", case.name);
    let url = case
        .create(&name, &[(QueueAttributeName::FifoQueue, "true")])
        .await?;
    let publisher = Publisher::new(case.client.clone(), &url).map_err(failed)?;
    let first = Payment::new("acc-x", 10).body();
    let changed = Payment::new("acc-x", 11).body();
    for _ in 0..10 {
        publisher
            .send(&Outgoing::new(first.as_str()).group("acc-x"))
            .await
            .map_err(failed)?;
    }
    let in_queue = case.depth(&url).await.map_err(failed)?;
    let apply = Apply::new();
    let inbox = MemoryInbox::new();
    let running = case.start(&url, inbox.clone(), apply.clone(), policy(3), 1)?;
    let drained = |n: usize| {
        let apply = apply.clone();
        let case = &case;
        let url = url.clone();
        async move {
            until(
                format!("{n} deliveries settled"),
                Duration::from_secs(30),
                || async {
                    let deliveries = deliveries(&name_of(&url));
                    let depth = case.depth(&url).await?;
                    if deliveries == n && depth == 0 {
                        Ok(())
                    } else {
                        Err(format!(
                            "{deliveries} deliveries, {depth} in the queue, {} applied",
                            apply.applied().len()
                        ))
                    }
                },
            )
            .await
        }
    };
    drained(1).await?;
    let inside = (deliveries(&name), apply.applied().len());
    publisher
        .send(&Outgoing::new(changed.as_str()).group("acc-x"))
        .await
        .map_err(failed)?;
    drained(2).await?;
    let after_change = (deliveries(&name), apply.applied().len());
    // "After the window": the same content, the same deduplication id.
    publisher
        .send(&Outgoing::new(first.as_str()).group("acc-x"))
        .await
        .map_err(failed)?;
    drained(3).await?;
    let after_window = (deliveries(&name), apply.applied().len());
    // The same message under another deduplication id and its message_id.
    let key = idem_sqs::content_digest(&first);
    publisher
        .send(
            &Outgoing::new(first.as_str())
                .group("acc-x")
                .message_id(key.as_str())
                .deduplication(Deduplication::Explicit(format!("{key}-resent"))),
        )
        .await
        .map_err(failed)?;
    drained(4).await?;
    let other_id = (deliveries(&name), apply.applied().len());
    running.stop().await?;
    check(in_queue == 1, || {
        format!("10 identical sends left {in_queue} messages in the queue")
    })?;
    check(
        inside == (1, 1) && after_change == (2, 2) && after_window == (3, 2) && other_id == (4, 2),
        || {
            format!(
                "(deliveries, effects): inside {inside:?}, changed {after_change:?}, after the window {after_window:?}, another dedup id {other_id:?}"
            )
        },
    )?;
    check(apply.balance("acc-x") == 21, || {
        format!("balance {}", apply.balance("acc-x"))
    })?;
    Ok(format!(
        "(deliveries, effects): 10 identical inside the window {inside:?}; a field changed {after_change:?}; the first again after the window {after_window:?}; under another dedup id {other_id:?}"
    ))
}

fn name_of(url: &str) -> String {
    url.rsplit('/').next().unwrap_or_default().to_owned()
}

/// How many deliveries the protocol decided for the consumer `name`
/// (its outcome lines).
fn deliveries(name: &str) -> usize {
    let consumer = format!("consumer={name}");
    Captured::text()
        .lines()
        .filter(|line| {
            line.contains(&consumer)
                && (line.contains("outcome=\"processed\"")
                    || line.contains("outcome=\"duplicate\""))
        })
        .count()
}
