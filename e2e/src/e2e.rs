//! `cargo xtask e2e`: the whole system, as users run it.
//!
//! Builds payments-axum, payments-actix and payments-consumer (release, or
//! with `--dev` the workspace's dev build, as CI runs it), starts a throwaway
//! PostgreSQL cluster, and runs every scenario of [`scenarios::CATALOG`]
//! against each example on each store (memory; SQLite in a temporary
//! directory; PostgreSQL, a fresh database per scenario; Redis, a node of the
//! scenario's own) as real processes on
//! 127.0.0.1, driven by a real HTTP client. Prints a table, scenario × example
//! × store → pass or fail with the figure behind it, ending in the line
//! `N passed, M failed`; exits non-zero on any failure.
//!
//! Beside them, payments-consumer against a throwaway RabbitMQ node (and
//! Kafka, SQS), on the same cluster and on SQLite: its scenarios
//! ([`consumer_harness`](crate::consumer_harness)) as rows of the same
//! table; and the outbox's chain ([`chain`], `--scenario chain`):
//! payments-axum publishing through its relay to payments-consumer on that
//! node, under SIGKILLs, on PostgreSQL (two API instances) and on SQLite
//! (one). Every row runs on servers, a store or a queue of its own, so they
//! share one set of [`SLOTS`], side by side; the rows that need the machine
//! or a shared server to themselves (a storm, the broker's restart, the
//! chain) run first, one after another, each with every slot, and those that
//! only need a quiet machine (the slow provider's 1 s leases) two at a time
//! ([`Room`]). The table's order does not depend on which ends first.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tokio::sync::Semaphore;

use idem_testkit::shell::Profile;

use crate::example::Example;

use self::api::Failure;
use self::postgres::Cluster;
use self::report::{Row, Verdict};
use self::scenarios::{CATALOG, Scenario};
use self::site::{Deployment, StoreKind, help_text};

mod api;
mod chain;
mod consumer;
mod orders;
mod postgres;
mod report;
mod scenarios;
mod site;

const USAGE: &str = "\
usage: cargo xtask e2e [--example axum|actix|consumer]... [--store memory|sqlite|postgres|redis]...
                       [--scenario NAME]... [--include-not-built] [--dev]

--dev: the binaries of the workspace's dev build (as `cargo test --workspace
--all-features` compiles their libraries; what CI runs), not release builds.

Without options: every example, every store, every scenario that is built
(the consumer's runs on RabbitMQ, Kafka and SQS, each with PostgreSQL and
with SQLite; the chain, axum → outbox → broker → consumer, on both, with
--example axum).";

/// Scenarios at once, HTTP and consumer rows together: 2 cores, and
/// most of a scenario's time is spent waiting (on a lease, a timeout, a
/// restart, a redelivery); each has servers, a store or a queue of its own.
/// On the two-core machine, 8 ran the shared rows in 0.63 of the time 5
/// did (94 s against 149); with the client rows added, 10 end them at 149 s
/// after the start against 167 s for 8 (three runs, every row passing).
/// With 267 rows, 14 end them at 158 s after the start against 181 s for
/// 10, and 18 at 170 s (the machine about half busy throughout: the rows
/// wait). (A RabbitMQ node of their own for the rows that restart the
/// broker, so that they run beside the others instead of alone, cost more
/// than it saved: the second node's CPU slowed the shared rows by 23 s.)
const SLOTS: u32 = 14;

/// What a scenario needs beside it while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Room {
    /// One slot: it runs beside any other.
    Shared,
    /// Half the slots: it runs beside one other such scenario and nothing
    /// else (its timing needs a quiet machine, not an empty one).
    Half,
    /// Every slot: it opens hundreds of connections, or stops a server
    /// that others share.
    Alone,
}

impl Room {
    fn places(self) -> u32 {
        match self {
            Room::Shared => 1,
            Room::Half => SLOTS / 2,
            Room::Alone => SLOTS,
        }
    }
}

/// The places scenarios take to run, as much as each one's [`Room`] asks.
#[derive(Clone, Debug)]
pub(crate) struct Slots(Arc<Semaphore>);

impl Slots {
    fn new() -> Self {
        Self(Arc::new(Semaphore::new(SLOTS as usize)))
    }

    /// Waits for the places `room` needs.
    pub(crate) async fn take(&self, room: Room) -> Option<tokio::sync::SemaphorePermit<'_>> {
        self.0.acquire_many(room.places()).await.ok()
    }
}
/// No scenario runs longer; the slowest wait out a 30 s lease.
const SCENARIO_LIMIT: Duration = Duration::from_secs(150);

struct Options {
    /// How the examples are built: release, or (`--dev`) CI's dev build.
    profile: Profile,
    examples: Vec<Example>,
    stores: Vec<StoreKind>,
    scenarios: Vec<String>,
    include_not_built: bool,
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    if args.iter().any(|arg| arg == "-h" || arg == "--help") {
        println!("{USAGE}");
        return Ok(());
    }
    let options = Options::parse(args)?;
    let started = Instant::now();
    let root = std::env::temp_dir().join(format!(
        "idem-e2e-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let ran = runtime.block_on(async {
        // Servers and the cluster stop when `everything` is dropped: on
        // Ctrl-C or SIGTERM too, not only at the end.
        let interrupted = interrupted().map_err(|e| format!("no signal handler: {e}"))?;
        tokio::select! {
            ran = everything(&options, &root) => Ok(ran),
            () = interrupted => Err("interrupted".to_owned()),
        }
    });
    // Blocking work cut short (a build, a cluster starting) gets its time to
    // finish, so that a cluster that comes up after all is stopped again.
    runtime.shutdown_timeout(Duration::from_secs(60));
    let (mut rows, built) = match ran {
        Ok(ran) => ran,
        Err(interrupted) => {
            let _ = std::fs::remove_dir_all(&root);
            return Err(interrupted);
        }
    };

    let failed = rows.iter().any(|r| matches!(r.verdict, Verdict::Fail(_)));
    let mut notes = vec![format!(
        "built in {} s, ran in {} s",
        built.as_secs(),
        (started.elapsed() - built).as_secs()
    )];
    if failed {
        notes.push(format!("server logs and stores: {}", root.display()));
    } else {
        let _ = std::fs::remove_dir_all(&root);
    }
    let totals = report::print(&mut rows, &notes);
    if totals.failed > 0 {
        // Not an `Err`: the last line printed stays `N passed, M failed`.
        std::process::exit(1);
    }
    Ok(())
}

/// Builds the examples (while PostgreSQL starts), then runs every scenario;
/// answers the rows and how long the build took.
async fn everything(options: &Options, root: &Path) -> (Vec<Row>, Duration) {
    let started = Instant::now();
    let starting = options.stores.contains(&StoreKind::Postgres).then(|| {
        let dir = root.join("postgres");
        tokio::task::spawn_blocking(move || Cluster::start(&dir))
    });
    // One cargo invocation for every binary (shared dependencies built once,
    // with one set of features), off the async workers.
    let mut examples: Vec<Example> = options
        .examples
        .iter()
        .copied()
        .filter(|e| *e != Example::Consumer)
        .collect();
    if options.runs_consumer() || options.runs_chain() {
        examples.push(Example::Consumer);
    }
    let orders_apps = options.orders_apps();
    examples.extend(orders_apps.iter().copied());
    let profile = options.profile;
    let packages: Vec<&'static str> = examples.iter().map(|e| e.package()).collect();
    let built = tokio::task::spawn_blocking(move || profile.build(&packages))
        .await
        .unwrap_or_else(|e| Err(format!("the build did not finish: {e}")));
    let binary = |example: Example| {
        built
            .as_ref()
            .map(|dir| example.binary(dir))
            .map_err(Clone::clone)
    };
    let orders_builds: Vec<(Example, Result<PathBuf, String>)> =
        orders_apps.iter().map(|&app| (app, binary(app))).collect();
    let builds: Vec<(Example, Result<PathBuf, String>)> = examples
        .iter()
        .filter(|e| **e != Example::Consumer && !orders_apps.contains(e))
        .map(|&example| (example, binary(example)))
        .collect();
    let consumer = options.runs_consumer().then(|| binary(Example::Consumer));
    let chain = options
        .runs_chain()
        .then(|| (binary(Example::Axum), binary(Example::Consumer)));
    let built = started.elapsed();
    let cluster: Result<Arc<Cluster>, String> = match starting {
        Some(starting) => match starting.await {
            Ok(started) => started.map(Arc::new),
            Err(e) => Err(format!("the cluster's start failed: {e}")),
        },
        None => Err("not started (no --store postgres)".to_owned()),
    };

    let mut rows = Vec::new();
    let mut deployments = Vec::new();
    for (example, build) in builds {
        match build {
            Ok(binary) => {
                let help = help_text(&binary);
                // A store none of the selected scenarios runs on is not probed.
                for &store in &options.stores {
                    if options.selected(store).next().is_none() {
                        continue;
                    }
                    deployments.push(Arc::new(Deployment::new(
                        example,
                        store,
                        binary.clone(),
                        help.clone(),
                        root,
                        cluster.clone(),
                    )));
                }
            }
            Err(why) => {
                for &store in &options.stores {
                    let failure = Failure::new("did not build", why.clone());
                    for (index, scenario) in options.selected(store) {
                        let failed = Err(failure.clone());
                        rows.extend(rows_of(index, scenario, example, store, &failed));
                    }
                }
            }
        }
    }
    // Two passes on one set of slots. First each deployment's probe, with
    // the broker and the consumer's other servers starting, then the rows
    // that need the machine to themselves, one after another: the storms,
    // the chain (its SIGKILLs under load). Queued among the others, each
    // would wait for the longest one running to end, every other slot idle
    // meanwhile. Then every other row, HTTP and consumer, side by side; the
    // consumer's rows that restart the broker first, while no other row on
    // it runs (they ran alone in the first pass, 28 s of a run with the
    // machine mostly idle).
    let slots = Slots::new();
    let phase = Instant::now();
    let wants_broker = consumer.is_some() || chain.is_some();
    let scenarios = options.consumer_scenarios();
    let (probes, broker, servers) = tokio::join!(
        join_all(deployments.iter().map(|deployment| {
            let slots = slots.clone();
            async move {
                let _slot = slots.take(Room::Shared).await;
                probe(deployment).await
            }
        })),
        async {
            match wants_broker {
                // One RabbitMQ node for the consumer's scenarios and the chain.
                true => Some(consumer::broker().await),
                false => None,
            }
        },
        async {
            match consumer.is_some() {
                true => consumer::Servers::start(&scenarios).await,
                false => consumer::Servers::default(),
            }
        },
    );
    let probed: Vec<(Arc<Deployment>, Result<(), Failure>)> =
        deployments.into_iter().zip(probes).collect();
    let consumer_rows = || {
        let (consumer, broker, cluster, slots) = (&consumer, &broker, &cluster, &slots);
        let (scenarios, servers) = (&scenarios, &servers);
        async move {
            let (Some(binary), Some(broker)) = (consumer.as_ref(), broker.as_ref()) else {
                return Vec::new();
            };
            consumer::rows(
                binary.clone(),
                broker.clone(),
                cluster.clone(),
                root,
                scenarios,
                &options.stores,
                servers,
                slots.clone(),
            )
            .await
        }
    };
    // The rows that need every slot, then those that pair up: queued
    // together, each pair would wait behind the storm queued between them.
    rows.extend(run_all(&probed, options, &slots, |s| s.room == Room::Alone).await);
    rows.extend(run_all(&probed, options, &slots, |s| s.room == Room::Half).await);
    if let (Some((api, consumer)), Some(broker)) = (chain, &broker) {
        let setup = chain::Setup {
            api,
            consumer,
            broker: broker.clone(),
            cluster: cluster.clone(),
        };
        rows.extend(chain::rows(setup, root, &options.stores, slots.clone()).await);
    }
    let orders = orders::rows(orders_builds, slots.clone());
    eprintln!(
        "e2e: the scenarios that run alone done after {:.0} s",
        phase.elapsed().as_secs_f64()
    );
    let http_long = run_all(&probed, options, &slots, |s| {
        s.room == Room::Shared && s.long
    });
    let http = async {
        let rows = run_all(&probed, options, &slots, |s| {
            s.room == Room::Shared && !s.long
        })
        .await;
        eprintln!(
            "e2e: the HTTP rows done after {:.0} s",
            phase.elapsed().as_secs_f64()
        );
        rows
    };
    let consumer_shared = async {
        let rows = consumer_rows().await;
        eprintln!(
            "e2e: the consumer's rows done after {:.0} s",
            phase.elapsed().as_secs_f64()
        );
        rows
    };
    // Polled in this order, so the slowest rows (the HTTP rows that wait
    // out a lease, the consumer's on SQS and Kafka) queue for slots first.
    let (http_long, consumer_shared, http, orders) =
        tokio::join!(http_long, consumer_shared, http, orders);
    rows.extend(http_long);
    rows.extend(http);
    rows.extend(consumer_shared);
    rows.extend(orders);
    servers.stop().await;
    // `rabbitmqctl stop` and the wait for the node, off the async workers.
    let _ = tokio::task::spawn_blocking(move || drop(broker)).await;
    (rows, built)
}

/// Resolves on Ctrl-C or SIGTERM; the handlers are installed at once.
fn interrupted() -> std::io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}

/// Every deployment's selected scenarios that `pass` takes, once its probe
/// has shown that the example starts on its store.
async fn run_all(
    probed: &[(Arc<Deployment>, Result<(), Failure>)],
    options: &Options,
    slots: &Slots,
    pass: fn(&Scenario) -> bool,
) -> Vec<Row> {
    join_all(probed.iter().map(|(deployment, probe)| {
        run_deployment(deployment.clone(), probe, options, slots.clone(), pass)
    }))
    .await
    .into_iter()
    .flatten()
    .collect()
}

/// One example on one store: its selected scenarios that `pass` takes.
async fn run_deployment(
    deployment: Arc<Deployment>,
    probe: &Result<(), Failure>,
    options: &Options,
    slots: Slots,
    pass: fn(&Scenario) -> bool,
) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut runs = Vec::new();
    let selected = options
        .selected(deployment.store)
        .filter(|(_, scenario)| pass(scenario));
    for (index, scenario) in selected {
        let (example, store) = (deployment.example, deployment.store);
        match (scenario.readiness.missing(&deployment), probe) {
            (Some(why), _) if !options.include_not_built => {
                rows.extend(not_built(index, scenario, example, store, &why));
            }
            (_, Err(failure)) => {
                rows.extend(rows_of(
                    index,
                    scenario,
                    example,
                    store,
                    &Err(failure.clone()),
                ));
            }
            _ => runs.push(run_scenario(
                index,
                scenario,
                deployment.clone(),
                slots.clone(),
            )),
        }
    }
    rows.extend(join_all(runs).await.into_iter().flatten());
    rows
}

/// Starts the example on a fresh store and reads an account.
async fn probe(deployment: &Deployment) -> Result<(), Failure> {
    let site = deployment.site("probe").await?;
    let instance = site.start(&[]).await?;
    instance.api.account("probe", "probe").await.map(|_| ())
}

async fn run_scenario(
    index: usize,
    scenario: &'static Scenario,
    deployment: Arc<Deployment>,
    slots: Slots,
) -> Vec<Row> {
    let _slots = slots.take(scenario.room).await;
    let started = Instant::now();
    let ran = tokio::time::timeout(SCENARIO_LIMIT, (scenario.run)(deployment.clone()))
        .await
        .unwrap_or_else(|_| {
            Err(Failure::new(
                "timed out",
                format!("the scenario ran past {} s", SCENARIO_LIMIT.as_secs()),
            ))
        });
    eprintln!(
        "e2e: {} on {} {}: {:.1} s",
        scenario.name,
        deployment.example.package(),
        deployment.store.name(),
        started.elapsed().as_secs_f64()
    );
    rows_of(index, scenario, deployment.example, deployment.store, &ran)
}

/// The scenario's rows, listed as not built for the reason given.
fn not_built(
    index: usize,
    scenario: &'static Scenario,
    example: Example,
    store: StoreKind,
    why: &str,
) -> Vec<Row> {
    scenario
        .checks
        .iter()
        .enumerate()
        .map(|(i, check)| Row {
            order: (index, i),
            check,
            example,
            store,
            verdict: Verdict::NotBuilt,
            figure: why.to_owned(),
        })
        .collect()
}

/// The scenario's rows from what it reported; a check it did not report fails.
fn rows_of(
    index: usize,
    scenario: &'static Scenario,
    example: Example,
    store: StoreKind,
    ran: &Result<scenarios::Checks, Failure>,
) -> Vec<Row> {
    scenario
        .checks
        .iter()
        .enumerate()
        .map(|(i, check)| {
            let outcome = match ran {
                Ok(checks) => checks
                    .iter()
                    .find(|(name, _)| name == check)
                    .map(|(_, outcome)| outcome.clone())
                    .unwrap_or_else(|| {
                        Err(Failure::new(
                            "not reported",
                            "the scenario did not report it",
                        ))
                    }),
                Err(failure) => Err(failure.clone()),
            };
            let (verdict, figure) = match outcome {
                Ok(figure) => (Verdict::Pass, figure),
                Err(failure) => (Verdict::Fail(failure.details), failure.figure),
            };
            Row {
                order: (index, i),
                check,
                example,
                store,
                verdict,
                figure,
            }
        })
        .collect()
}

impl Options {
    fn parse(args: &[String]) -> Result<Self, String> {
        let mut args = args.to_vec();
        let profile = Profile::take_from(&mut args, Profile::Release);
        let mut options = Self {
            profile,
            examples: Vec::new(),
            stores: Vec::new(),
            scenarios: Vec::new(),
            include_not_built: false,
        };
        let mut args = args.iter().map(String::as_str);
        while let Some(arg) = args.next() {
            match (arg, args.clone().next()) {
                ("--example", Some(name)) => {
                    options.examples.push(match name {
                        "axum" => Example::Axum,
                        "actix" => Example::Actix,
                        "consumer" => Example::Consumer,
                        _ => return Err(format!("no example {name:?}\n\n{USAGE}")),
                    });
                    args.next();
                }
                ("--store", Some(name)) => {
                    let store = StoreKind::ALL
                        .into_iter()
                        .find(|s| s.name() == name)
                        .ok_or_else(|| format!("no store {name:?}\n\n{USAGE}"))?;
                    options.stores.push(store);
                    args.next();
                }
                ("--scenario", Some(name)) => {
                    if !CATALOG.iter().any(|s| s.name == name)
                        && !consumer::has(name)
                        && !chain::has(name)
                        && !orders::has(name)
                    {
                        let names: Vec<&str> = CATALOG
                            .iter()
                            .map(|s| s.name)
                            .chain(consumer::names())
                            .chain([chain::NAME, orders::NAME])
                            .collect();
                        return Err(format!(
                            "no scenario {name:?}; there are {}",
                            names.join(", ")
                        ));
                    }
                    options.scenarios.push(name.to_owned());
                    args.next();
                }
                ("--include-not-built", _) => options.include_not_built = true,
                _ => return Err(format!("unexpected {arg:?}\n\n{USAGE}")),
            }
        }
        if options.examples.is_empty() {
            options.examples = vec![Example::Axum, Example::Actix, Example::Consumer];
        }
        if options.stores.is_empty() {
            options.stores = StoreKind::ALL.to_vec();
        }
        Ok(options)
    }

    /// Whether the consumer's scenarios run: the example is selected, and
    /// PostgreSQL or SQLite, and a consumer scenario (or no scenario at all).
    fn runs_consumer(&self) -> bool {
        self.examples.contains(&Example::Consumer)
            && !consumer::backends(&self.stores).is_empty()
            && (self.scenarios.is_empty() || self.scenarios.iter().any(|n| consumer::has(n)))
    }

    /// Whether the chain runs: axum selected (the consumer is built for it),
    /// PostgreSQL or SQLite, and `--scenario chain` (or no scenario at all).
    fn runs_chain(&self) -> bool {
        self.examples.contains(&Example::Axum)
            && !chain::backends(&self.stores).is_empty()
            && (self.scenarios.is_empty() || self.scenarios.iter().any(|n| chain::has(n)))
    }

    /// The orders apps whose crash rows run: the orders app of each payments
    /// example selected, with SQLite, and `--scenario orders-crash` (or no
    /// scenario at all).
    fn orders_apps(&self) -> Vec<Example> {
        let selected = self.stores.contains(&StoreKind::Sqlite)
            && (self.scenarios.is_empty() || self.scenarios.iter().any(|n| orders::has(n)));
        if !selected {
            return Vec::new();
        }
        self.examples
            .iter()
            .filter_map(|&example| orders::orders_of(example))
            .collect()
    }

    /// The consumer scenarios named on the command line (none: all of them).
    fn consumer_scenarios(&self) -> Vec<String> {
        self.scenarios
            .iter()
            .filter(|n| consumer::has(n))
            .cloned()
            .collect()
    }

    /// The scenarios selected that apply to `store`, with their place in the catalogue.
    fn selected(&self, store: StoreKind) -> impl Iterator<Item = (usize, &'static Scenario)> + '_ {
        CATALOG.iter().enumerate().filter(move |(_, scenario)| {
            scenario.stores.contains(&store)
                && (self.scenarios.is_empty() || self.scenarios.iter().any(|n| n == scenario.name))
        })
    }
}
