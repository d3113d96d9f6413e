//! The consumer section: messages per second through idem-rabbitmq with the
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
//! first in even rounds, bare first in odd ones), and each row pools its
//! rounds.
//!
//! **Why the consumers run in `bench-server`:** `cargo xtask bench` runs this
//! crate as a dev build, while `bench-server` is built like every process
//! the bench measures (release, or the dev build with `--dev`), so the
//! consumers are measured optimized; and a process of its own per run gives
//! each its own CPU reading, fresh pool and Tokio runtime (2 workers, as the
//! unpinned servers of the PostgreSQL rows). Nothing is pinned: RabbitMQ,
//! PostgreSQL and the consumer share both CPUs, as in the PostgreSQL
//! section.

use std::process::Command;
use std::time::Duration;

use idem_testkit::TestRabbitMq;

use super::load::Measured;
use super::postgres::{cluster, url};
use super::process::helper_json;
use super::report::{Ratio, Report, Row, Target};
use super::{Bench, short_id};

/// What one drain reads.
#[derive(Clone, Copy)]
enum Store {
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
enum Kind {
    Idem,
    Bare,
}

impl Kind {
    fn flag(self) -> &'static str {
        match self {
            Self::Idem => "idem",
            Self::Bare => "bare",
        }
    }
}

/// Starts the broker, the cluster and the SQLite file; runs every row; stops
/// them.
pub(super) fn consumer(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let broker = TestRabbitMq::start().map_err(|e| e.to_string())?;
    let (cluster, port) = cluster(bench, "consumer")?;
    let dir = bench.logs.join(format!("consumer-{}", short_id()));
    let outcome = std::fs::create_dir_all(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))
        .and_then(|()| {
            let databases = [
                (Store::Postgres, url(port, "consumer")),
                (
                    Store::Sqlite,
                    format!("sqlite://{}", dir.join("consumer.db").display()),
                ),
            ];
            rows(bench, report, &broker.url(), &databases)
        });
    cluster.finish(Duration::from_secs(30));
    drop(broker);
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

fn rows(
    bench: &Bench,
    report: &mut Report,
    amqp: &str,
    databases: &[(Store, String)],
) -> Result<(), String> {
    let settings = &bench.settings;
    report.notes.push(format!(
        "consumer rows: req/s is messages/s, the drain of {} pre-published messages \
         (after {} of warm-up); srv is the consumer process; prefetch {PREFETCH}; nothing pinned",
        settings.consumer_messages, settings.consumer_warmup,
    ));
    for &c in &settings.consumer_concurrencies {
        for database in databases {
            let mut idem = Measured::default();
            let mut bare = Measured::default();
            for round in 0..settings.rounds {
                let order = if round % 2 == 0 {
                    [Kind::Idem, Kind::Bare]
                } else {
                    [Kind::Bare, Kind::Idem]
                };
                for kind in order {
                    let drained = drain(bench, amqp, database, kind, c)?;
                    match kind {
                        Kind::Idem => idem = std::mem::take(&mut idem).pooled(drained),
                        Kind::Bare => bare = std::mem::take(&mut bare).pooled(drained),
                    }
                }
            }
            add(report, database.0, c, &idem, &bare);
        }
    }
    Ok(())
}

/// The prefetch of both consumers: idem-rabbitmq's default.
const PREFETCH: u16 = 32;

/// One `bench-server consume` run, as a load run: its messages, the drain's
/// seconds, its CPU time and PostgreSQL's.
fn drain(
    bench: &Bench,
    amqp: &str,
    (store, database): &(Store, String),
    kind: Kind,
    c: usize,
) -> Result<Measured, String> {
    let settings = &bench.settings;
    let store = match store {
        Store::Postgres => "postgres",
        Store::Sqlite => "sqlite",
    };
    let queue = format!("bench-{}-{store}-{}-c{c}", short_id(), kind.flag());
    let mut command = Command::new(&bench.binaries.server);
    command
        .args(["consume", "--amqp", amqp, "--queue", &queue])
        .args(["--database", database, "--consumer", kind.flag()])
        .args(["--concurrency", &c.to_string()])
        .args(["--prefetch", &PREFETCH.to_string()])
        .args(["--messages", &settings.consumer_messages.to_string()])
        .args(["--warmup", &settings.consumer_warmup.to_string()]);
    let json = helper_json(command, Duration::from_secs(600))?;
    let messages = json["messages"]
        .as_u64()
        .ok_or_else(|| format!("consume answered no messages: {json}"))?;
    let seconds = json["seconds"]
        .as_f64()
        .ok_or_else(|| format!("consume answered no seconds: {json}"))?;
    Ok(Measured {
        requests: messages,
        answered: messages,
        seconds,
        run_seconds: seconds,
        server_cpu_seconds: json["cpu_seconds"].as_f64(),
        database_cpu_seconds: json["database_cpu_seconds"].as_f64(),
        ..Measured::default()
    })
}

/// The two rows of a store at `c`, and their ratios.
fn add(report: &mut Report, store: Store, c: usize, idem: &Measured, bare: &Measured) {
    let (inbox, name) = (store.inbox(), store.name());
    report.rows.push(
        Row::from_load("consumer", format!("idem-rabbitmq + {inbox}"), c, idem).without_latency(),
    );
    report.rows.push(
        Row::from_load(
            "consumer",
            format!("bare lapin + the same {name} transaction"),
            c,
            bare,
        )
        .without_latency(),
    );
    let consumer_cpu = match (
        idem.server_micros_per_request(),
        bare.server_micros_per_request(),
    ) {
        (Some(idem), Some(bare)) => {
            format!("consumer CPU per message: idem {idem:.1} us, bare {bare:.1} us")
        }
        _ => String::new(),
    };
    report.ratios.push(
        Ratio::new(
            format!("idem-rabbitmq + {inbox} / bare lapin, msgs/s (c={c})"),
            idem.rps() / bare.rps(),
            Target::AtLeast(0.85),
        )
        .note(consumer_cpu),
    );
    if let (Some(idem_cost), Some(bare_cost)) = (
        idem.database_micros_per_request(),
        bare.database_micros_per_request(),
    ) {
        let what =
            format!("idem-rabbitmq + {inbox} / bare lapin, PostgreSQL CPU per message (c={c})");
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
