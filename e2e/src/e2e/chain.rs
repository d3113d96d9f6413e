//! The chain (issue 23): payments-axum with `--publish` (its relay in the
//! process) → RabbitMQ → payments-consumer, while clients retry charges
//! with random timeouts and the API and the consumer are `SIGKILL`ed and
//! restarted. On PostgreSQL two API instances share the database (two
//! relays); on SQLite one instance (SQLite has a single relay). At the end,
//! once the outbox has drained and the queue is empty, every account at the
//! consumer equals the API's, each event was applied once, none is unsent.
//!
//! On RabbitMQ the queue is capped at 3 messages with `overflow:
//! reject-publish` (a policy, so that every declaration stays as it is):
//! while the consumer is down the broker refuses (`basic.nack`) what the
//! relays publish, a refusal that can pass, retried and never parked.
//!
//! The same chain runs on Kafka (`--publish kafka://…`, `run --kafka`, on a
//! throwaway tansu broker): the relay's idempotent producer, the account as
//! the record key, the consumer's offsets in its transaction. RabbitMQ's
//! memory alarm (which blocks the relays so that one is killed mid-batch)
//! has no Kafka counterpart: there the API is killed wherever it is.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use idem_testkit::{TestKafka, TestRabbitMq};

use crate::consumer_harness::{self, Case, Client, ConsumerProcess};
use crate::example::Example;

use super::api::{Account, Api, Call, Failure};
use super::postgres::Cluster;
use super::report::{Row, Verdict};
use super::scenarios::{CATALOG, random_millis, unique};
use super::site::{Deployment, Instance, Site, StoreKind};
use super::{Room, Slots};

/// Selects the chain (`--scenario chain`), on PostgreSQL and on SQLite.
pub(crate) const NAME: &str = "chain";

const CHECK_POSTGRES: &str = "outbox chain: 300 charges, 2 APIs + relays → RabbitMQ (queue capped at 3, reject-publish) → consumer, SIGKILL 3+3, balances equal";
const CHECK_SQLITE: &str = "outbox chain: 300 charges, 1 API + relay → RabbitMQ (queue capped at 3, reject-publish) → consumer, SIGKILL 3+3, balances equal";
const CHECK_KAFKA_POSTGRES: &str =
    "outbox chain: 300 charges, 1 API + relay → Kafka → consumer, SIGKILL 3+3, balances equal";
const CHECK_KAFKA_SQLITE: &str =
    "outbox chain: 300 charges, 1 API + relay → Kafka → consumer, SIGKILL 3+3, balances equal";

const CHARGES: usize = 300;
const ACCOUNTS: usize = 30;
/// Clients charging at once, each a charge at a time.
const CLIENTS: usize = 10;
/// Kills of each side, spread over the charges.
const KILLS: usize = 3;
/// The whole chain; it takes about 10 s.
const LIMIT: Duration = Duration::from_secs(120);
/// How long one charge may take to settle (an instance restarting, a lease).
const SETTLE: Duration = Duration::from_secs(30);
/// How long the outbox and the queue may take to drain after the charges.
const DRAIN: Duration = Duration::from_secs(30);
const PRINCIPAL: &str = "chain";
/// What a relay logs when the broker refused a publish (`basic.nack`).
const REFUSED: [&str; 2] = ["outbox event not published", "refused"];

/// Whether `name` selects the chain.
pub(crate) fn has(name: &str) -> bool {
    name == NAME
}

/// The chain's databases among `stores`.
pub(crate) fn backends(stores: &[StoreKind]) -> Vec<StoreKind> {
    [StoreKind::Postgres, StoreKind::Sqlite]
        .into_iter()
        .filter(|store| stores.contains(store))
        .collect()
}

/// What the chain runs with: the two binaries, the broker, the cluster.
pub(crate) struct Setup {
    pub(crate) api: Result<PathBuf, String>,
    pub(crate) consumer: Result<PathBuf, String>,
    pub(crate) broker: Result<Arc<TestRabbitMq>, String>,
    pub(crate) cluster: Result<Arc<Cluster>, String>,
}

/// The broker a chain runs through.
#[derive(Clone)]
enum Bus {
    RabbitMq(Arc<TestRabbitMq>),
    Kafka(Arc<TestKafka>),
}

impl Bus {
    fn name(&self) -> &'static str {
        match self {
            Self::RabbitMq(_) => "rabbitmq",
            Self::Kafka(_) => "kafka",
        }
    }

    /// `--publish`'s URL.
    fn publish_url(&self) -> String {
        match self {
            Self::RabbitMq(broker) => broker.url(),
            Self::Kafka(broker) => format!("kafka://{}", broker.servers()),
        }
    }
}

/// Runs the chain on each of `stores`' databases and each bus, one after
/// the other, each with every slot (two API instances, their relays, a
/// consumer, a load of clients and SIGKILLs: the machine to itself, as it
/// was measured), and answers its rows.
pub(crate) async fn rows(
    setup: Setup,
    root: &Path,
    stores: &[StoreKind],
    slots: Slots,
) -> Vec<Row> {
    // The broker keeps its records in SQLite: the relay produces its events
    // a batch at a time, and a consumer killed then started again fetches
    // from its stored position, which may fall inside one of those batches.
    // Kafka serves that fetch the batch's records from the position on, as
    // tansu's SQLite engine does (it stores each record); its in-memory
    // engine serves it the next batch instead, skipping the rest of that one
    // (an event the consumer never saw, once in a CI run).
    let kafka = if backends(stores).is_empty() {
        None
    } else {
        Some(
            match tokio::task::spawn_blocking(TestKafka::start_durable).await {
                Ok(Ok(broker)) => Ok(Arc::new(broker)),
                Ok(Err(why)) => Err(format!("no Kafka broker: {why}")),
                Err(why) => Err(format!("the Kafka broker's start failed: {why}")),
            },
        )
    };
    let buses = [
        setup.broker.clone().map(Bus::RabbitMq),
        kafka
            .clone()
            .unwrap_or_else(|| Err("not started".to_owned()))
            .map(Bus::Kafka),
    ];
    let runs = buses.iter().enumerate().flat_map(|(on_kafka, bus)| {
        backends(stores)
            .into_iter()
            .map(move |store| (on_kafka, bus, store))
    });
    let rows = join_all(runs.map(|(on_kafka, bus, store)| {
        let (setup, slots) = (&setup, slots.clone());
        async move {
            let _slots = slots.take(Room::Alone).await;
            let started = Instant::now();
            let outcome = match (&setup.api, &setup.consumer, bus) {
                (Err(why), _, _) => Err(Failure::new("did not build", why.clone())),
                (_, Err(why), _) => Err(Failure::new("consumer did not build", why.clone())),
                (_, _, Err(why)) => Err(Failure::new("no broker", why.clone())),
                (Ok(api), Ok(consumer), Ok(broker)) => {
                    let deployment = Deployment::new(
                        Example::Axum,
                        store,
                        api.clone(),
                        String::new(),
                        root,
                        setup.cluster.clone(),
                    );
                    tokio::time::timeout(
                        LIMIT,
                        run(&deployment, consumer, broker, &setup.cluster, root),
                    )
                    .await
                    .unwrap_or_else(|_| {
                        Err(Failure::new(
                            "timed out",
                            format!("the chain ran past {} s", LIMIT.as_secs()),
                        ))
                    })
                }
            };
            let (verdict, figure) = match outcome {
                Ok(figure) => (
                    Verdict::Pass,
                    format!("{figure}; {} s", started.elapsed().as_secs()),
                ),
                Err(failure) => (Verdict::Fail(failure.details), failure.figure),
            };
            Row {
                // After the HTTP catalogue and the consumer's scenarios.
                order: (
                    CATALOG.len()
                        + consumer_harness::SCENARIOS.len()
                        + consumer_harness::KAFKA_SCENARIOS.len(),
                    on_kafka,
                ),
                check: match (on_kafka == 1, store == StoreKind::Postgres) {
                    (false, true) => CHECK_POSTGRES,
                    (false, false) => CHECK_SQLITE,
                    (true, true) => CHECK_KAFKA_POSTGRES,
                    (true, false) => CHECK_KAFKA_SQLITE,
                },
                example: Example::Axum,
                store,
                verdict,
                figure,
            }
        }
    }))
    .await;
    // The Kafka broker stops here, off the async workers.
    drop(buses);
    let _ = tokio::task::spawn_blocking(move || drop(kafka)).await;
    rows
}

/// The API instances clients talk to, by slot; a slot's client is replaced
/// when its instance restarts (on another port).
struct Fleet {
    apis: Mutex<Vec<Api>>,
}

impl Fleet {
    fn pick(&self) -> Api {
        let apis = self
            .apis
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = usize::try_from(random_millis(0, apis.len() as u64 - 1)).unwrap_or(0);
        apis[i].clone()
    }

    fn replace(&self, slot: usize, api: Api) {
        self.apis
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)[slot] = api;
    }
}

/// How the clients' charges went.
#[derive(Default)]
struct Load {
    attempts: usize,
    timeouts: usize,
    broken: usize,
    waits: usize,
}

async fn run(
    deployment: &Deployment,
    consumer_binary: &Path,
    bus: &Bus,
    cluster: &Result<Arc<Cluster>, String>,
    root: &Path,
) -> Result<String, Failure> {
    let store = deployment.store;
    let site = deployment.site(&format!("{NAME}_{}", bus.name())).await?;
    let queue = format!("chain_{}_{}", bus.name(), store.name());
    let logs = root.join(format!("chain-consumer-{}-{}", bus.name(), store.name()));
    let database = consumer_database(store, cluster, &logs).await?;
    let case = match bus {
        Bus::RabbitMq(broker) => Case::new(consumer_binary, broker.url(), database, &queue, &logs),
        Bus::Kafka(broker) => Case::new(consumer_binary, String::new(), database, &queue, &logs)
            .with_kafka(broker.servers()),
    };
    let publish = bus.publish_url();
    let flags = [
        "--publish",
        publish.as_str(),
        "--publish-to",
        queue.as_str(),
        // A claim cut off by SIGKILL (outside a transaction) is void soon.
        "--lease-secs",
        "3",
    ];
    // The queue capped: full whenever the consumer is down or behind.
    let policy = format!("capped-{queue}");
    if let Bus::RabbitMq(broker) = bus {
        ctl(
            broker,
            &[
                "set_policy",
                "--apply-to",
                "queues",
                &policy,
                &format!("^{queue}$"),
                r#"{"max-length":3,"overflow":"reject-publish"}"#,
            ],
        )
        .await?;
    }
    // Two relays on PostgreSQL, through RabbitMQ. Through tansu 0.6, one:
    // with two producers at once it has reported a topic's ends below the
    // offsets it served, and a chain through it has ended one event short
    // with nothing unsent and the consumer's positions at the topic's ends
    // (by the broker's own ends, nothing was left to read). Two relays'
    // order and once-only are the RabbitMQ rows'.
    let instances = match (store, bus) {
        (StoreKind::Postgres, Bus::RabbitMq(_)) => 2,
        _ => 1,
    };
    let mut running: Vec<Instance> = Vec::new();
    for _ in 0..instances {
        running.push(site.start(&flags).await?);
    }
    let fleet = Arc::new(Fleet {
        apis: Mutex::new(running.iter().map(|i| i.api.clone()).collect()),
    });
    let consumer = start_consumer(&case)
        .await
        .map_err(|why| Failure::new("consumer did not start", why))?;
    let mut consumer_logs = vec![consumer.log.clone()];

    let prefix = unique("acct");
    let accounts: Vec<String> = (0..ACCOUNTS).map(|i| format!("{prefix}-{i:02}")).collect();
    let calls: Vec<(String, Call, i64)> = (0..CHARGES)
        .map(|i| {
            let account = &accounts[i % ACCOUNTS];
            let amount = i64::try_from(random_millis(1, 1000)).unwrap_or(1);
            let call = Call::charge(PRINCIPAL, account, &unique("key"), amount);
            (account.clone(), call, amount)
        })
        .collect();
    let mut expected: BTreeMap<String, Account> = BTreeMap::new();
    for (account, _, amount) in &calls {
        let entry = expected.entry(account.clone()).or_insert(Account {
            balance: 0,
            operations: 0,
        });
        entry.balance += amount;
        entry.operations += 1;
    }

    // The clients: each takes the next charge and retries it (same key) with
    // a random timeout per attempt, on whichever instance, until it is final.
    let settled = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let calls = Arc::new(calls);
    let clients = join_all((0..CLIENTS).map(|_| {
        let (fleet, settled, next, calls) =
            (fleet.clone(), settled.clone(), next.clone(), calls.clone());
        async move {
            let mut load = Load::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((_, call, _)) = calls.get(i) else {
                    return Ok(load);
                };
                charge(&fleet, call, &mut load).await?;
                settled.fetch_add(1, Ordering::Relaxed);
                // Paced, so that the kills fall among the charges.
                tokio::time::sleep(Duration::from_millis(random_millis(50, 250))).await;
            }
        }
    }));

    // The API's kills: one instance at a time, at a quarter, half and three
    // quarters of the charges, each restarted at once; how many events were
    // unsent at each. Before the first, the broker blocks publishers (its
    // memory alarm) until events wait: the relays hold batches they cannot
    // get confirmed, and one of them is killed mid-batch.
    let api_kills = async {
        let mut unsent_at_kill = Vec::new();
        for k in 0..KILLS {
            wait_for(&settled, CHARGES * (k + 1) / (KILLS + 1)).await;
            let rabbitmq = match bus {
                Bus::RabbitMq(broker) => Some(broker),
                Bus::Kafka(_) => None,
            };
            let mid_batch = k == 0 && rabbitmq.is_some();
            if mid_batch && let Some(broker) = rabbitmq {
                ctl(broker, &["set_vm_memory_high_watermark", "0"]).await?;
            }
            let killed = async {
                if mid_batch {
                    wait_unsent(&site, 5).await?;
                }
                let slot = k % running.len();
                unsent_at_kill.push(outbox(&site).await?.map_or(-1, |o| o.unsent));
                running.swap_remove(slot).kill();
                let restarted = site.start(&flags).await?;
                fleet.replace(slot, restarted.api.clone());
                running.push(restarted);
                let last = running.len() - 1;
                running.swap(slot, last);
                Ok::<_, Failure>(())
            }
            .await;
            if mid_batch && let Some(broker) = rabbitmq {
                // RabbitMQ 3.x's default.
                ctl(broker, &["set_vm_memory_high_watermark", "0.4"]).await?;
            }
            killed?;
        }
        Ok::<_, Failure>(unsent_at_kill)
    };
    // The consumer's kills, between the API's. On RabbitMQ the first keeps
    // the consumer down until the capped queue has refused a publish.
    let consumer_kills = async {
        let mut consumer = consumer;
        for k in 0..KILLS {
            wait_for(&settled, CHARGES * (2 * k + 1) / (2 * KILLS + 2)).await;
            consumer.kill().await;
            if k == 0 && matches!(bus, Bus::RabbitMq(_)) {
                let deadline = Instant::now() + SETTLE;
                while site.log_lines(&REFUSED) == 0 {
                    if Instant::now() > deadline {
                        return Err(Failure::new(
                            "the queue never refused",
                            format!(
                                "no relay logged a refused publish within {SETTLE:?} of the consumer's kill, the queue capped at 3"
                            ),
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            consumer = start_consumer(&case)
                .await
                .map_err(|why| Failure::new("consumer did not restart", why))?;
            consumer_logs.push(consumer.log.clone());
        }
        Ok::<_, Failure>(consumer)
    };
    let started = Instant::now();
    let (loads, unsent_at_kill, consumer) = tokio::join!(clients, api_kills, consumer_kills);
    let unsent_at_kill = unsent_at_kill?;
    let consumer = consumer?;
    let mut load = Load::default();
    for client in loads {
        let client = client?;
        load.attempts += client.attempts;
        load.timeouts += client.timeouts;
        load.broken += client.broken;
        load.waits += client.waits;
    }
    let charged = started.elapsed();

    // The API must hold each charge once.
    let api = fleet.pick();
    let mut at_api = BTreeMap::new();
    for account in &accounts {
        at_api.insert(account.clone(), api.account(PRINCIPAL, account).await?);
    }
    if at_api != expected {
        return Err(Failure::new(
            "API balances wrong",
            format!(
                "GET /accounts/… answered {at_api:?}\nexpected (each charge once): {expected:?}"
            ),
        ));
    }

    // Drain: every event sent, the queue empty, the consumer caught up.
    let drained = drain(&site, &case, bus, &at_api).await?;
    let outbox = outbox(&site).await?;
    if let Some(outbox) = &outbox
        && (outbox.sent != CHARGES as i64 || outbox.unsent != 0 || outbox.parked != 0)
    {
        return Err(Failure::new(
            format!("outbox: {} sent, {} unsent", outbox.sent, outbox.unsent),
            format!(
                "the API's idem_outbox after the drain: {} sent, {} unsent, {} parked; \
                 expected {CHARGES} sent (one event per charge), none unsent or parked",
                outbox.sent, outbox.unsent, outbox.parked
            ),
        ));
    }
    drop(consumer);
    drop(running);
    let (deliveries, duplicates) = inbox_outcomes(&consumer_logs);
    let published = outbox.map_or_else(|| "?".to_owned(), |o| o.sent.to_string());
    let first = match bus {
        Bus::RabbitMq(broker) => {
            ctl(broker, &["clear_policy", &policy]).await?;
            let refused = site.log_lines(&REFUSED);
            if refused == 0 {
                return Err(Failure::new(
                    "the queue never refused",
                    "no relay logged a refused publish: the capped queue was never full, and the chain proved nothing of refusals",
                ));
            }
            format!("the first mid-batch; {refused} publishes refused by the full queue, retried; ")
        }
        Bus::Kafka(_) => String::new(),
    };
    Ok(format!(
        "{CHARGES} charges applied once in {} s ({} attempts, {} timeouts, {} broken, {} waits); \
         {published} events published, {deliveries} deliveries, {duplicates} duplicates absorbed \
         by the inbox; API kills {KILLS} ({first}unsent at kill {unsent_at_kill:?}), consumer \
         kills {KILLS}; drained in {:.1} s",
        charged.as_secs(),
        load.attempts,
        load.timeouts,
        load.broken,
        load.waits,
        drained.as_secs_f64(),
    ))
}

/// Retries `call` (the same key) until a final answer, each attempt with a
/// random timeout on a random instance; a final answer other than 201 fails.
async fn charge(fleet: &Fleet, call: &Call, load: &mut Load) -> Result<(), Failure> {
    let deadline = Instant::now() + SETTLE;
    loop {
        load.attempts += 1;
        let timeout = Duration::from_millis(random_millis(2, 100));
        let pause = match fleet.pick().send_within(call, Some(timeout)).await {
            Ok(Some(answer)) if answer.status == 201 => return Ok(()),
            Ok(Some(answer)) if answer.status == 409 || answer.status >= 500 => {
                load.waits += 1;
                Duration::from_millis(50)
            }
            Ok(Some(answer)) => return Err(Failure::unexpected(call, "201", &answer)),
            Ok(None) => {
                load.timeouts += 1;
                Duration::from_millis(10)
            }
            Err(_) => {
                load.broken += 1;
                Duration::from_millis(50)
            }
        };
        if Instant::now() > deadline {
            return Err(Failure::new(
                "never settled",
                format!("request: {call}\nexpected: 201 within {SETTLE:?}"),
            ));
        }
        tokio::time::sleep(pause).await;
    }
}

/// `rabbitmqctl ARGS…` on the node.
async fn ctl(broker: &Arc<TestRabbitMq>, args: &[&str]) -> Result<(), Failure> {
    let broker = broker.clone();
    let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
    super::site::blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        broker
            .ctl(&args)
            .map(drop)
            .map_err(|e| format!("rabbitmqctl {}: {e}", args.join(" ")))
    })
    .await
}

/// Waits (bounded) until at least `count` events are unsent.
async fn wait_unsent(site: &Site, count: i64) -> Result<(), Failure> {
    let started = Instant::now();
    loop {
        let Some(outbox) = outbox(site).await? else {
            return Err(Failure::new(
                "no outbox",
                "the API's store has no SQL database to read the outbox from",
            ));
        };
        if outbox.unsent >= count {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(10) {
            return Err(Failure::new(
                "relays not blocked",
                format!(
                    "the broker's memory alarm is on, yet after 10 s only {} events are unsent",
                    outbox.unsent
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_for(counter: &AtomicUsize, at_least: usize) {
    while counter.load(Ordering::Relaxed) < at_least {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Starts the consumer with the inbox's outcomes logged (`idem=debug`). On
/// Kafka each start joins a group of its own: tansu 0.6 gives a member that
/// joins while a killed one is still in its group no partition, and does not
/// rebalance when the killed one's session expires (a Kafka broker would);
/// the positions are the database's either way.
async fn start_consumer(case: &Case) -> Result<ConsumerProcess, String> {
    static STARTS: AtomicUsize = AtomicUsize::new(0);
    let env = [("RUST_LOG", "info,idem=debug")];
    if case.kafka.is_some() {
        let group = format!("{}-{}", case.queue, STARTS.fetch_add(1, Ordering::Relaxed));
        case.consumer_with_env(&env, &["--group", &group]).await
    } else {
        case.consumer_with_env(&env, &[]).await
    }
}

/// The consumer's own database: one of the cluster, or a SQLite file.
async fn consumer_database(
    store: StoreKind,
    cluster: &Result<Arc<Cluster>, String>,
    logs: &Path,
) -> Result<String, Failure> {
    if store == StoreKind::Sqlite {
        std::fs::create_dir_all(logs)
            .map_err(|e| Failure::new("no directory", format!("{}: {e}", logs.display())))?;
        return Ok(format!("sqlite://{}", logs.join("consumer.db").display()));
    }
    let cluster = cluster
        .as_ref()
        .map_err(|why| Failure::new("no PostgreSQL", why.clone()))?
        .clone();
    super::site::blocking(move || cluster.create_database()).await
}

/// The API's outbox: events sent, unsent, parked.
struct Outbox {
    sent: i64,
    unsent: i64,
    parked: i64,
}

/// Reads the API's `idem_outbox`; `None` for a store without SQL.
async fn outbox(site: &Site) -> Result<Option<Outbox>, Failure> {
    const COUNTS: &str = "SELECT \
        (SELECT count(*) FROM idem_outbox WHERE sent_at IS NOT NULL), \
        (SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL AND parked_at IS NULL), \
        (SELECT count(*) FROM idem_outbox WHERE parked_at IS NOT NULL)";
    let Some(text) = site.query(COUNTS).await? else {
        return Ok(None);
    };
    let counts: Vec<i64> = text
        .split('|')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    match counts[..] {
        [sent, unsent, parked] => Ok(Some(Outbox {
            sent,
            unsent,
            parked,
        })),
        _ => Err(Failure::new(
            "unreadable outbox",
            format!("{COUNTS} answered {text:?}"),
        )),
    }
}

/// Waits (bounded) until the outbox has nothing unsent, the queue is empty
/// and the consumer's accounts equal `at_api`; then checks again after a
/// moment (a late duplicate must change nothing) and that nothing is
/// dead-lettered. Answers how long it took.
async fn drain(
    site: &Site,
    case: &Case,
    bus: &Bus,
    at_api: &BTreeMap<String, Account>,
) -> Result<Duration, Failure> {
    let client = Queue::open(case, bus).await?;
    let started = Instant::now();
    let mut last = String::new();
    loop {
        let unsent = outbox(site).await?.map_or(0, |o| o.unsent);
        let ready = client.ready(case).await?;
        let at_consumer = consumer_accounts(case).await?;
        if unsent == 0 && ready == 0 && &at_consumer == at_api {
            break;
        }
        last = format!(
            "{unsent} events unsent, {ready} messages ready in {}; the consumer holds \
             {at_consumer:?}\nthe API holds {at_api:?}",
            case.queue
        );
        if started.elapsed() > DRAIN {
            return Err(Failure::new(
                "did not drain",
                format!("after {DRAIN:?}: {last}"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ready = client.ready(case).await.unwrap_or(u64::MAX);
    let dead = client.dead(case).await.unwrap_or(u64::MAX);
    let at_consumer = consumer_accounts(case).await?;
    client.close().await;
    if ready != 0 || dead != 0 || &at_consumer != at_api {
        return Err(Failure::new(
            "changed after the drain",
            format!(
                "half a second after the drain: {ready} messages ready, {dead} dead letters; \
                 the consumer holds {at_consumer:?}\nthe API holds {at_api:?}\n(before: {last})"
            ),
        ));
    }
    Ok(drained)
}

/// What is left for the consumer on the broker.
enum Queue {
    /// The queue's client: its ready messages.
    RabbitMq(Box<Client>),
    /// The topic's records past the consumer's stored positions.
    Kafka(String),
}

impl Queue {
    async fn open(case: &Case, bus: &Bus) -> Result<Self, Failure> {
        match bus {
            Bus::RabbitMq(_) => Client::connect(case)
                .await
                .map(|client| Self::RabbitMq(Box::new(client)))
                .map_err(|why| Failure::new("no broker client", why)),
            Bus::Kafka(broker) => Ok(Self::Kafka(broker.servers())),
        }
    }

    /// Messages (records) not yet consumed.
    async fn ready(&self, case: &Case) -> Result<u64, Failure> {
        match self {
            Self::RabbitMq(client) => client
                .ready(&case.queue)
                .await
                .map(u64::from)
                .map_err(|why| Failure::new("queue unreadable", why)),
            Self::Kafka(servers) => {
                let (servers, topic) = (servers.clone(), case.queue.clone());
                let ends: i64 = super::site::blocking(move || topic_ends(&servers, &topic)).await?;
                let database = case
                    .database()
                    .await
                    .map_err(|why| Failure::new("consumer database", why))?;
                let passed = consumer_harness::kafka_positions(&database, &case.queue)
                    .await
                    .map_err(|why| Failure::new("consumer positions", why))?;
                // tansu 0.6 has reported a topic's ends below the offsets
                // its records were read at (two producers at once): past
                // the ends counts as nothing left.
                Ok(u64::try_from(ends - passed).unwrap_or(0))
            }
        }
    }

    /// Dead letters.
    async fn dead(&self, case: &Case) -> Result<u64, Failure> {
        match self {
            Self::RabbitMq(client) => client
                .ready(&client.topology.dead_letter_queue())
                .await
                .map(u64::from)
                .map_err(|why| Failure::new("queue unreadable", why)),
            Self::Kafka(servers) => idem_kafka::dead_letters(servers, &case.queue)
                .await
                .map(|letters| letters.len() as u64)
                .map_err(|e| Failure::new("dead letters unreadable", e.to_string())),
        }
    }

    async fn close(self) {
        if let Self::RabbitMq(client) = self {
            (*client).close().await;
        }
    }
}

/// The sum of the topic's partitions' ends (its records, from offset 0).
fn topic_ends(servers: &str, topic: &str) -> Result<i64, String> {
    use idem_kafka::rdkafka::ClientConfig;
    use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
    let client: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .create()
        .map_err(|e| e.to_string())?;
    let metadata = client
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    let mut ends = 0;
    for partition in metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic)
        .flat_map(|t| t.partitions())
    {
        let (_, high) = client
            .fetch_watermarks(topic, partition.id(), Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        ends += high;
    }
    Ok(ends)
}

/// Every account in the consumer's database (what `payments-consumer balance` prints).
async fn consumer_accounts(case: &Case) -> Result<BTreeMap<String, Account>, Failure> {
    let database = case
        .database()
        .await
        .map_err(|why| Failure::new("consumer database", why))?;
    let accounts = database
        .accounts()
        .await
        .map_err(|e| Failure::new("consumer database", e.to_string()))?;
    Ok(accounts
        .into_iter()
        .map(|a| {
            (
                a.account_id,
                Account {
                    balance: a.balance,
                    operations: a.operations,
                },
            )
        })
        .collect())
}

/// Deliveries the consumers decided on, and how many of them were
/// duplicates the inbox acknowledged without applying: their `outcome`
/// lines at `idem=debug`.
fn inbox_outcomes(logs: &[PathBuf]) -> (usize, usize) {
    let mut deliveries = 0;
    let mut duplicates = 0;
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines() {
            if line.contains("outcome=\"processed\"") || line.contains("outcome=processed") {
                deliveries += 1;
            } else if line.contains("outcome=\"duplicate\"") || line.contains("outcome=duplicate") {
                deliveries += 1;
                duplicates += 1;
            }
        }
    }
    (deliveries, duplicates)
}
