//! The consumer sections, `consumer` (RabbitMQ), `kafka` and `sqs`: messages
//! per second through idem-rabbitmq (or idem-kafka, or idem-sqs) with the
//! PostgreSQL inbox (`PgInbox`) and the SQLite one (`SqliteInbox`), each
//! against a bare lapin consumer applying the same transaction without an
//! inbox, at the same prefetch and concurrency; and PostgreSQL's CPU time
//! per message on both sides.
//!
//! Each run is one `bench-server consume` (see its module docs): on a
//! throwaway RabbitMQ node (`TestRabbitMq`) and this section's PostgreSQL
//! cluster or SQLite file, it publishes the payments to a fresh queue, warms
//! its consumer up on a queue of its own, then measures the time to drain the
//! queue (the consumer's count reaching the messages published, every one
//! acknowledged after its commit) and reads its own CPU time and
//! PostgreSQL's at both ends of that window, with the bench's own readings
//! (`idem_testkit::cpu`), so that the set-up, the publishing and the
//! warm-up are left out. The compared runs alternate within each round (idem
//! first in even rounds, bare first in odd ones). Each row shows its median
//! round (the quick mode runs 7, the full one 3), and each ratio the median
//! of the rounds' ratios, idem's drain over the bare one's next to it: a
//! drain slowed by the machine (they last one to three seconds in the quick
//! mode, 3,000 messages: with 1,000, two quick runs' ratios differed by up to
//! 23 %, the consumer's start and stop a large part of each window) moves
//! neither. The CPU time per message pools every round.
//!
//! **Why the consumers run in `bench-server`:** `cargo xtask bench` runs this
//! crate as a dev build, while `bench-server` is built like every process
//! the bench measures (release, or the dev build with `--dev`), so the
//! consumers are measured optimized; and a process of its own per run gives
//! each its own CPU reading, fresh pool and Tokio runtime (2 workers, as the
//! unpinned servers of the PostgreSQL rows). Nothing is pinned: RabbitMQ,
//! PostgreSQL and the consumer share both CPUs, as in the PostgreSQL
//! section.

use std::cell::RefCell;
use std::process::Command;
use std::rc::Rc;
use std::time::Duration;

use idem_testkit::{TestKafka, TestRabbitMq, TestSqs};

use super::load::Measured;
use super::postgres::{cluster, url};
use super::process::helper_json;
use super::report::{Figure, Ratio, Report, Row, Target};
use super::{Bench, short_id};

/// What one drain reads.
#[derive(Clone, Copy)]
pub(super) enum Store {
    Postgres,
    Sqlite,
}

impl Store {
    fn inbox(self) -> &'static str {
        match self {
            Self::Postgres => "PgInbox",
            Self::Sqlite => "SqliteInbox",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Postgres => "PostgreSQL",
            Self::Sqlite => "SQLite",
        }
    }
}

/// The consumers compared.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Idem,
    Bare,
}

impl Kind {
    pub(super) fn flag(self) -> &'static str {
        match self {
            Self::Idem => "idem",
            Self::Bare => "bare",
        }
    }
}

/// The broker a section drains from.
#[derive(Clone)]
pub(super) enum On {
    /// RabbitMQ, at this AMQP URL: idem-rabbitmq against bare lapin.
    RabbitMq(String),
    /// Kafka (tansu), at these bootstrap servers: idem-kafka against a bare
    /// rdkafka consumer with auto-commit.
    Kafka(String),
    /// SQS (moto's server), at this endpoint: idem-sqs against a bare
    /// aws-sdk-sqs receive, apply, delete loop; each run's time of one SQS
    /// call on the server (`sqs_call_ms`) is kept for the section's note.
    Sqs(String, Rc<RefCell<Vec<f64>>>),
}

impl On {
    pub(super) fn section(&self) -> &'static str {
        match self {
            Self::RabbitMq(_) => "consumer",
            Self::Kafka(_) => "kafka",
            Self::Sqs(..) => "sqs",
        }
    }

    pub(super) fn idem(&self) -> &'static str {
        match self {
            Self::RabbitMq(_) => "idem-rabbitmq",
            Self::Kafka(_) => "idem-kafka",
            Self::Sqs(..) => "idem-sqs",
        }
    }

    pub(super) fn bare(&self) -> &'static str {
        match self {
            Self::RabbitMq(_) => "bare lapin",
            Self::Kafka(_) => "bare rdkafka (auto-commit)",
            Self::Sqs(..) => "bare aws-sdk-sqs loop",
        }
    }

    /// The messages each run drains, measured, and first, unmeasured.
    fn messages(&self, settings: &super::Settings) -> (usize, usize) {
        match self {
            Self::Sqs(..) => (settings.sqs_messages, settings.sqs_warmup),
            _ => (settings.consumer_messages, settings.consumer_warmup),
        }
    }
}

/// Starts the broker, the cluster and the SQLite file; runs every row; stops
/// them.
pub(super) fn consumer(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let broker = TestRabbitMq::start().map_err(|e| e.to_string())?;
    let on = On::RabbitMq(broker.url());
    let outcome = on_databases(bench, report, &on, &bench.settings.consumer_concurrencies);
    drop(broker);
    outcome
}

/// The same rows on Kafka (`tansu`, in memory): idem-kafka, the offsets in
/// the effect's transaction, against a bare rdkafka consumer with
/// auto-commit; each concurrency is the topic's partitions.
pub(super) fn kafka(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let broker = TestKafka::start().map_err(|e| e.to_string())?;
    let on = On::Kafka(broker.servers());
    on_databases(bench, report, &on, &bench.settings.kafka_concurrencies)
}

/// The same rows on SQS (moto's server, one Python process on the same
/// CPUs): idem-sqs against a bare aws-sdk-sqs loop making the same calls per
/// message (a receive of up to 10, a delete after the commit); and what one
/// SQS call costs on the server, in a note, since that cost is in both
/// sides' time.
pub(super) fn sqs(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let server = TestSqs::start().map_err(|e| e.to_string())?;
    let calls = Rc::new(RefCell::new(Vec::new()));
    let on = On::Sqs(server.endpoint(), Rc::clone(&calls));
    let outcome = on_databases(bench, report, &on, &bench.settings.sqs_concurrencies);
    let calls = calls.borrow();
    if !calls.is_empty() {
        let mean = calls.iter().sum::<f64>() / calls.len() as f64;
        report.notes.push(format!(
            "sqs rows: moto answers one SQS call in {mean:.1} ms (mean of GetQueueUrl before \
             each drain), on the CPUs the consumer and the database use; a message costs \
             both consumers 2 calls (its delete, and a share of a receive of up to 10), so most \
             of a drain is moto's on both sides and the ratio understates the inbox's cost next \
             to the bare loop's; AWS's calls are network round trips of a few ms that cost the \
             consumer no CPU: compare the consumer CPU per message, which moto does not inflate"
        ));
    }
    drop(server);
    outcome
}

/// A section's rows on one broker and its database.
pub(super) type BrokerRows = fn(&Bench, &mut Report, &On, &(Store, String)) -> Result<(), String>;

/// Runs `rows` on RabbitMQ, then on Kafka, each with PostgreSQL (one
/// throwaway cluster, `section` its database): the sections that compare the
/// consumers beyond their speed (`backlog`, `instructions`).
pub(super) fn on_each_broker(
    bench: &Bench,
    report: &mut Report,
    section: &str,
    rows: BrokerRows,
) -> Result<(), String> {
    let (cluster, port) = cluster(bench, section)?;
    let database = (Store::Postgres, url(port, section));
    let outcome = TestRabbitMq::start()
        .map_err(|e| e.to_string())
        .and_then(|broker| rows(bench, report, &On::RabbitMq(broker.url()), &database))
        .and_then(|()| TestKafka::start().map_err(|e| e.to_string()))
        .and_then(|broker| rows(bench, report, &On::Kafka(broker.servers()), &database));
    cluster.finish(Duration::from_secs(30));
    outcome
}

/// The `backlog` section: each consumer's peak resident set draining a
/// backlog of the settings' `backlog_messages` (100,000 in the quick and full runs),
/// published by another process first, one message at a time at the
/// broker's higher concurrency (RabbitMQ 32, Kafka 4 partitions), on
/// PostgreSQL: whether what a consumer holds follows its prefetch or the
/// backlog (compare the consumer rows' peak RSS, with a backlog of a few
/// thousand).
pub(super) fn backlog(bench: &Bench, report: &mut Report) -> Result<(), String> {
    report.notes.push(format!(
        "backlog rows: each consumer drains a backlog of {} messages published first by \
         another process, one at a time, on PostgreSQL; peak RSS is the consumer process's \
         VmHWM over its whole run; compare the consumer rows' peak RSS with a backlog of {}",
        bench.settings.backlog_messages, bench.settings.consumer_messages
    ));
    on_each_broker(bench, report, "backlog", backlog_rows)
}

fn backlog_rows(
    bench: &Bench,
    report: &mut Report,
    on: &On,
    database: &(Store, String),
) -> Result<(), String> {
    let settings = &bench.settings;
    let c = match on {
        On::Kafka(_) => settings.kafka_concurrencies.last(),
        _ => settings.consumer_concurrencies.last(),
    }
    .copied()
    .unwrap_or(1);
    let messages = settings.backlog_messages;
    let mut peaks = Vec::new();
    for kind in [Kind::Idem, Kind::Bare] {
        let spec = Spec {
            kind,
            c,
            batch: None,
            messages,
            warmup: settings.consumer_warmup,
        };
        let drained = Drain::of(&drain_published(bench, on, database, &spec, &[])?)?;
        let what = match kind {
            Kind::Idem => format!("{} + PgInbox, backlog of {messages}", on.idem()),
            Kind::Bare => format!("{}, backlog of {messages}", on.bare()),
        };
        report
            .rows
            .push(Row::from_load("backlog", what.clone(), c, &drained.measured).without_latency());
        let mib = drained
            .peak_rss
            .map(|bytes| bytes as f64 / (1024.0 * 1024.0));
        report.figures.push(Figure {
            section: "backlog",
            what: format!("{what}: peak RSS (c={c})"),
            value: mib,
            unit: "MiB",
            note: "VmHWM of the consumer process".to_owned(),
        });
        peaks.push(mib);
    }
    if let [Some(idem), Some(bare)] = peaks[..] {
        report.ratios.push(
            Ratio::new(
                format!(
                    "{} + PgInbox / {}, peak RSS with a backlog of {messages} (c={c})",
                    on.idem(),
                    on.bare()
                ),
                idem / bare,
                Target::None,
            )
            .note(format!("idem {idem:.1} MiB, bare {bare:.1} MiB")),
        );
    }
    Ok(())
}

fn on_databases(
    bench: &Bench,
    report: &mut Report,
    on: &On,
    concurrencies: &[usize],
) -> Result<(), String> {
    let section = on.section();
    let (cluster, port) = cluster(bench, section)?;
    let dir = bench.logs.join(format!("{section}-{}", short_id()));
    let outcome = std::fs::create_dir_all(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))
        .and_then(|()| {
            let databases = [
                (Store::Postgres, url(port, section)),
                (
                    Store::Sqlite,
                    format!("sqlite://{}", dir.join(format!("{section}.db")).display()),
                ),
            ];
            rows(bench, report, on, concurrencies, &databases)
        });
    cluster.finish(Duration::from_secs(30));
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

fn rows(
    bench: &Bench,
    report: &mut Report,
    on: &On,
    concurrencies: &[usize],
    databases: &[(Store, String)],
) -> Result<(), String> {
    let settings = &bench.settings;
    report.notes.push(match on {
        On::RabbitMq(_) => format!(
            "consumer rows: req/s is messages/s, the drain of {} pre-published messages \
             (after {} of warm-up); srv is the consumer process; prefetch {PREFETCH}; nothing pinned",
            settings.consumer_messages, settings.consumer_warmup,
        ),
        On::Kafka(_) => format!(
            "kafka rows: req/s is messages/s, the drain of {} pre-produced records (after {} of \
             warm-up) on tansu (in memory); c is the topic's partitions: idem-kafka applies each \
             in order, the bare consumer up to c records at once in no order; each window opens \
             at the consumer's first record (not its join and first fetch) and closes once it \
             stopped; srv is the consumer process; nothing pinned",
            settings.consumer_messages, settings.consumer_warmup,
        ),
        On::Sqs(..) => format!(
            "sqs rows: req/s is messages/s, the drain of {} pre-sent messages (after {} of \
             warm-up) from a standard queue on moto's server; both consumers receive up to \
             min(10, free slots) a call and delete each message after its commit; srv is the \
             consumer process; nothing pinned",
            settings.sqs_messages, settings.sqs_warmup,
        ),
    });
    for &c in concurrencies {
        for database in databases {
            let mut idem = Vec::new();
            let mut bare = Vec::new();
            for round in 0..settings.consumer_rounds {
                let order = if round % 2 == 0 {
                    [Kind::Idem, Kind::Bare]
                } else {
                    [Kind::Bare, Kind::Idem]
                };
                for kind in order {
                    let drained = drain(
                        bench,
                        on,
                        database,
                        Spec::of(on, settings, kind, c, None, 1),
                    )?;
                    match kind {
                        Kind::Idem => idem.push(drained),
                        Kind::Bare => bare.push(drained),
                    }
                }
            }
            add(
                report,
                on,
                database.0,
                c,
                &Rounds::of(idem),
                &Rounds::of(bare),
            );
        }
    }
    if matches!(on, On::RabbitMq(_) | On::Kafka(_)) {
        batch_rows(bench, report, on, databases)?;
    }
    Ok(())
}

/// The batch size the batch rows' targets are set at.
const BATCH_TARGETED: usize = 128;

/// The batch rows' idem drains are this many times the other rows'
/// messages: a batch drains a thousand messages in a fifth of a second, in
/// which the consumer's start and stop would weigh as much as the drain.
/// Their bare drains, one message at a time, are the other rows' length.
const BATCH_SCALE: usize = 4;

/// idem's consumer with a batch handler (`ConsumerBuilder::batch_handler`,
/// one batch at a time) at each of the settings' batch sizes (1, 16 and
/// 128; the smoke run 128 alone), against the bare consumer
/// one message at a time (c = 1). Each batch size's drain has a bare drain
/// of its own next to it in every round (the bare one first in odd rounds),
/// as the other rows' pairs: with one bare drain a round for the three
/// sizes, the middle size was never next to it, and two quick runs' ratios
/// at batch 16 differed by 20 %. The reference row pools every bare drain.
fn batch_rows(
    bench: &Bench,
    report: &mut Report,
    on: &On,
    databases: &[(Store, String)],
) -> Result<(), String> {
    let settings = &bench.settings;
    report.notes.push(format!(
        "{} batch rows: {}'s batch handler, one batch at a time (on Kafka, one partition), draining {BATCH_SCALE} times the other rows' messages (each next to a bare drain of its own, the other rows' length), each batch's new messages applied with two statements on PostgreSQL (the accounts' UPDATE from the batch's sums, one multi-row INSERT) and on SQLite each account's UPDATE and one multi-row INSERT on the connection's thread at once, one commit; on Kafka the worker's queue holds 8 batches; against the bare consumer at c=1; targets at {}: 3x on PostgreSQL, 2x on SQLite",
        on.section(),
        on.idem(),
        BATCH_TARGETED
    ));
    for database in databases {
        let batches = &settings.consumer_batches;
        let mut idem: Vec<Vec<Drain>> = batches.iter().map(|_| Vec::new()).collect();
        let mut bare: Vec<Vec<Drain>> = batches.iter().map(|_| Vec::new()).collect();
        for round in 0..settings.consumer_rounds {
            for (i, &batch) in batches.iter().enumerate() {
                let mut pair = [
                    Spec::of(on, settings, Kind::Idem, 1, Some(batch), BATCH_SCALE),
                    Spec::of(on, settings, Kind::Bare, 1, None, 1),
                ];
                if round % 2 == 1 {
                    pair.reverse();
                }
                for spec in pair {
                    let drained = drain(bench, on, database, spec)?;
                    match spec.kind {
                        Kind::Idem => idem[i].push(drained),
                        Kind::Bare => bare[i].push(drained),
                    }
                }
            }
        }
        let (inbox, name) = (database.0.inbox(), database.0.name());
        let reference = Rounds::of(bare.iter().flatten().cloned().collect());
        for ((drains, bare), &batch) in idem.into_iter().zip(bare).zip(batches) {
            let (idem, bare) = (Rounds::of(drains), Rounds::of(bare));
            report.rows.push(
                Row::from_load(
                    on.section(),
                    format!("{} + {inbox}, batch {batch}", on.idem()),
                    1,
                    &idem.median(),
                )
                .without_latency(),
            );
            let target = match (batch, database.0) {
                (BATCH_TARGETED, Store::Postgres) => Target::AtLeast(3.0),
                (BATCH_TARGETED, Store::Sqlite) => Target::AtLeast(2.0),
                _ => Target::None,
            };
            let ratios = Ratios::of(&idem, &bare);
            let cpu = match (
                idem.pooled.server_micros_per_request(),
                idem.pooled.database_micros_per_request(),
            ) {
                (Some(consumer), Some(database)) => format!(
                    "; CPU per message: consumer {consumer:.1} us, PostgreSQL {database:.1} us"
                ),
                (Some(consumer), None) => format!("; consumer CPU per message {consumer:.1} us"),
                _ => String::new(),
            };
            let cpu = match idem.peak_rss_mib {
                Some(rss) => format!("{cpu}; peak RSS {rss:.1} MiB"),
                None => cpu,
            };
            report.ratios.push(
                Ratio::new(
                    format!(
                        "{} + {inbox}, batch {batch} / {} one at a time (c=1), msgs/s",
                        on.idem(),
                        on.bare()
                    ),
                    ratios.median(),
                    target,
                )
                .note(format!(
                    "{} against the bare consumer and the same {name} transaction{cpu}",
                    ratios.described()
                )),
            );
        }
        report.rows.push(
            Row::from_load(
                on.section(),
                format!(
                    "{} + the same {name} transaction (batch rows' reference)",
                    on.bare()
                ),
                1,
                &reference.median(),
            )
            .without_latency(),
        );
    }
    Ok(())
}

/// How long one consume run may take.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(600);

/// The prefetch of both consumers: idem-rabbitmq's default.
const PREFETCH: u16 = 32;

/// What one consume run drains, and with which consumer.
#[derive(Clone, Copy)]
pub(super) struct Spec {
    pub(super) kind: Kind,
    pub(super) c: usize,
    /// idem's batch handler at this size; `None`: one message at a time.
    pub(super) batch: Option<usize>,
    /// Messages drained, measured.
    pub(super) messages: usize,
    /// Messages drained first, unmeasured.
    pub(super) warmup: usize,
}

impl Spec {
    /// The section's usual drain, its messages `scale` times the settings'.
    fn of(
        on: &On,
        settings: &super::Settings,
        kind: Kind,
        c: usize,
        batch: Option<usize>,
        scale: usize,
    ) -> Self {
        let (messages, warmup) = on.messages(settings);
        Self {
            kind,
            c,
            batch,
            messages: messages.saturating_mul(scale),
            warmup,
        }
    }

    /// A fresh queue (or topic) name for one run.
    pub(super) fn queue(&self, store: Store) -> String {
        let store = match store {
            Store::Postgres => "postgres",
            Store::Sqlite => "sqlite",
        };
        format!(
            "bench-{}-{store}-{}-c{}-b{}",
            short_id(),
            self.kind.flag(),
            self.c,
            self.batch.unwrap_or(0)
        )
    }
}

/// Adds a consume command's arguments (`consume`, `kafka-consume` or
/// `sqs-consume`, by broker) for `spec`'s drain of `queue` to `command`:
/// `bench-server` itself, or a tool that runs it.
pub(super) fn consume_args(
    command: &mut Command,
    on: &On,
    database: &str,
    spec: &Spec,
    queue: &str,
) {
    match on {
        On::RabbitMq(amqp) => command
            .args(["consume", "--amqp", amqp, "--queue", queue])
            .args(["--prefetch", &PREFETCH.to_string()]),
        On::Kafka(servers) => command.args(["kafka-consume", "--kafka", servers, "--topic", queue]),
        On::Sqs(endpoint, _) => {
            command.args(["sqs-consume", "--sqs-endpoint", endpoint, "--queue", queue])
        }
    };
    command
        .args(["--database", database, "--consumer", spec.kind.flag()])
        .args(["--concurrency", &spec.c.to_string()])
        .args(["--messages", &spec.messages.to_string()])
        .args(["--warmup", &spec.warmup.to_string()])
        .args(spec.batch.map(|size| format!("--batch={size}")));
}

/// One `bench-server consume` run, as a load run: its messages, the drain's
/// seconds, its CPU time and PostgreSQL's.
fn drain(
    bench: &Bench,
    on: &On,
    (store, database): &(Store, String),
    spec: Spec,
) -> Result<Drain, String> {
    let mut command = Command::new(&bench.binaries.server);
    consume_args(&mut command, on, database, &spec, &spec.queue(*store));
    let json = helper_json(command, DRAIN_TIMEOUT)?;
    if let (On::Sqs(_, calls), Some(ms)) = (on, json["sqs_call_ms"].as_f64()) {
        calls.borrow_mut().push(ms);
    }
    Drain::of(&json)
}

/// Publishes `spec`'s messages with one `bench-server` run, then drains
/// them with another, `bench-server` itself or run by `runner` (a program and
/// its arguments, `bench-server`'s path and arguments after them): the
/// drain's process then holds the consumer alone, not the publisher (its
/// peak RSS, its instructions). Answers the drain's JSON.
pub(super) fn drain_published(
    bench: &Bench,
    on: &On,
    (store, database): &(Store, String),
    spec: &Spec,
    runner: &[String],
) -> Result<serde_json::Value, String> {
    let queue = spec.queue(*store);
    let mut publish = Command::new(&bench.binaries.server);
    consume_args(&mut publish, on, database, spec, &queue);
    publish.arg("--publish-only");
    helper_json(publish, DRAIN_TIMEOUT)?;
    let mut command = match runner {
        [program, args @ ..] => {
            let mut command = Command::new(program);
            command.args(args).arg(&bench.binaries.server);
            command
        }
        [] => Command::new(&bench.binaries.server),
    };
    consume_args(&mut command, on, database, spec, &queue);
    command.arg("--published");
    helper_json(command, DRAIN_TIMEOUT)
}

/// One drain: as a load run, and the PostgreSQL statements it ran.
#[derive(Clone)]
struct Drain {
    measured: Measured,
    /// `None` on SQLite, or when `pg_stat_statements` could not be read.
    statements: Option<u64>,
    /// The consumer process's peak resident set (`VmHWM`), its warm-up and
    /// the drain of its pre-published backlog included.
    peak_rss: Option<u64>,
}

impl Drain {
    /// What a consume run printed.
    fn of(json: &serde_json::Value) -> Result<Self, String> {
        let messages = json["messages"]
            .as_u64()
            .ok_or_else(|| format!("consume answered no messages: {json}"))?;
        let seconds = json["seconds"]
            .as_f64()
            .ok_or_else(|| format!("consume answered no seconds: {json}"))?;
        Ok(Self {
            measured: Measured {
                requests: messages,
                answered: messages,
                seconds,
                run_seconds: seconds,
                server_cpu_seconds: json["cpu_seconds"].as_f64(),
                database_cpu_seconds: json["database_cpu_seconds"].as_f64(),
                ..Measured::default()
            },
            statements: json["statements"].as_u64(),
            peak_rss: json["peak_rss_bytes"].as_u64(),
        })
    }
}

/// One consumer's drains of a row, a round each.
struct Rounds {
    drains: Vec<Measured>,
    /// Every drain as one: for the CPU time per message.
    pooled: Measured,
    /// PostgreSQL's statements per message over every drain.
    statements: Option<f64>,
    /// The highest peak resident set of the rounds' consumers, in MiB.
    peak_rss_mib: Option<f64>,
}

impl Rounds {
    fn of(drains: Vec<Drain>) -> Self {
        let statements = drains
            .iter()
            .map(|drain| drain.statements)
            .sum::<Option<u64>>();
        let peak_rss_mib = drains
            .iter()
            .filter_map(|drain| drain.peak_rss)
            .max()
            .map(|bytes| bytes as f64 / (1024.0 * 1024.0));
        let drains: Vec<Measured> = drains.into_iter().map(|drain| drain.measured).collect();
        let pooled = drains
            .iter()
            .cloned()
            .fold(Measured::default(), Measured::pooled);
        let statements = statements
            .filter(|_| pooled.answered > 0)
            .map(|statements| statements as f64 / pooled.answered as f64);
        Self {
            drains,
            pooled,
            statements,
            peak_rss_mib,
        }
    }

    /// The drain of median messages/s (the upper one of an even count).
    fn median(&self) -> Measured {
        let mut drains = self.drains.clone();
        drains.sort_by(|a, b| a.rps().total_cmp(&b.rps()));
        drains.get(drains.len() / 2).cloned().unwrap_or_default()
    }
}

/// The rounds' ratios of messages/s, each round's idem drain over its bare
/// one, in increasing order.
struct Ratios(Vec<f64>);

impl Ratios {
    fn of(idem: &Rounds, bare: &Rounds) -> Self {
        let mut ratios: Vec<f64> = idem
            .drains
            .iter()
            .zip(&bare.drains)
            .map(|(idem, bare)| idem.rps() / bare.rps())
            .collect();
        ratios.sort_by(f64::total_cmp);
        Self(ratios)
    }

    /// The median (the upper one of an even count), the row's ratio.
    fn median(&self) -> f64 {
        self.0.get(self.0.len() / 2).copied().unwrap_or(f64::NAN)
    }

    /// `median of N rounds`, and the rounds' spread when there are several.
    fn described(&self) -> String {
        let rounds = self.0.len();
        match (self.0.first(), self.0.last()) {
            (Some(low), Some(high)) if rounds > 1 => {
                format!("median of {rounds} rounds (from {low:.2} to {high:.2})")
            }
            _ => format!("median of {rounds} rounds"),
        }
    }
}

/// The two rows of a store at `c` (each its median round), and their ratios.
fn add(report: &mut Report, on: &On, store: Store, c: usize, idem: &Rounds, bare: &Rounds) {
    let (inbox, name) = (store.inbox(), store.name());
    let (section, idem_name, bare_name) = (on.section(), on.idem(), on.bare());
    let rounds = idem.drains.len();
    report.rows.push(
        Row::from_load(section, format!("{idem_name} + {inbox}"), c, &idem.median())
            .without_latency(),
    );
    report.rows.push(
        Row::from_load(
            section,
            format!("{bare_name} + the same {name} transaction"),
            c,
            &bare.median(),
        )
        .without_latency(),
    );
    let ratios = Ratios::of(idem, bare);
    if let (Some(idem), Some(bare)) = (idem.statements, bare.statements) {
        report.ratios.push(
            Ratio::new(
                format!(
                    "{idem_name} + {inbox} / {bare_name}, PostgreSQL statements per message (c={c})"
                ),
                idem / bare,
                Target::None,
            )
            .note(format!(
                "pg_stat_statements calls per message (BEGIN and COMMIT included, each \
                 pipelined statement counted; the consumer's start and stop included): \
                 idem {idem:.2}, bare {bare:.2}"
            )),
        );
    }
    let (idem_rss, bare_rss) = (idem.peak_rss_mib, bare.peak_rss_mib);
    let messages = idem.pooled.answered / (rounds.max(1) as u64);
    let (idem, bare) = (&idem.pooled, &bare.pooled);
    let consumer_cpu = match (
        idem.server_micros_per_request(),
        bare.server_micros_per_request(),
    ) {
        (Some(idem), Some(bare)) => {
            format!("consumer CPU per message: idem {idem:.1} us, bare {bare:.1} us")
        }
        _ => String::new(),
    };
    let consumer_cpu = match (idem_rss, bare_rss) {
        (Some(idem), Some(bare)) => format!(
            "{consumer_cpu}; peak RSS draining its backlog of {messages}: idem {idem:.1} MiB, bare {bare:.1} MiB"
        ),
        _ => consumer_cpu,
    };
    report.ratios.push(
        Ratio::new(
            format!("{idem_name} + {inbox} / {bare_name}, msgs/s (c={c})"),
            ratios.median(),
            Target::AtLeast(0.9),
        )
        .note(format!("{}; {consumer_cpu}", ratios.described())),
    );
    if let (Some(idem_cost), Some(bare_cost)) = (
        idem.database_micros_per_request(),
        bare.database_micros_per_request(),
    ) {
        let what =
            format!("{idem_name} + {inbox} / {bare_name}, PostgreSQL CPU per message (c={c})");
        report.ratios.push(if bare_cost > 0.0 {
            Ratio::new(what, idem_cost / bare_cost, Target::None).note(format!(
                "PostgreSQL CPU per message: idem {idem_cost:.1} us, bare {bare_cost:.1} us"
            ))
        } else {
            Ratio::missing(
                what,
                Target::None,
                "the drain was too short for CPU time counted in clock ticks",
            )
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{Measured, Ratios, Rounds};

    /// A consumer's drains of `rates` messages/s, one a round.
    fn rounds(rates: &[u64]) -> Rounds {
        let drains: Vec<Measured> = rates
            .iter()
            .map(|&rate| Measured {
                requests: rate,
                answered: rate,
                seconds: 1.0,
                ..Measured::default()
            })
            .collect();
        Rounds {
            pooled: drains
                .iter()
                .cloned()
                .fold(Measured::default(), Measured::pooled),
            drains,
            statements: None,
            peak_rss_mib: None,
        }
    }

    #[test]
    fn a_row_is_the_median_of_its_rounds_ratios_with_their_spread() {
        // Each round's idem drain over the bare one beside it: 0.5, 0.9, 0.8.
        let ratios = Ratios::of(&rounds(&[500, 900, 400]), &rounds(&[1000, 1000, 500]));
        assert_eq!(ratios.median(), 0.8);
        assert_eq!(ratios.described(), "median of 3 rounds (from 0.50 to 0.90)");
        let one = Ratios::of(&rounds(&[700]), &rounds(&[1000]));
        assert_eq!(one.median(), 0.7);
        assert_eq!(one.described(), "median of 1 rounds");
    }
}
