//! The outbox section (idem-diesel's `PgOutbox`, its relay and idem-rabbitmq's
//! `OutboxPublisher`), on a throwaway PostgreSQL cluster and RabbitMQ node:
//!
//! - **Staging**: the layered route on `PgStore` in transactional mode whose
//!   handler writes a row of its own in the request's transaction, as a
//!   charge does (`bench-server serve --write`), against the same route whose
//!   handler also stages one event (`PgOutbox::stage`, with its `NOTIFY`),
//!   pipelined with that write as the outbox's docs show (`--write
//!   --outbox`): first executions at the PostgreSQL rows' concurrencies,
//!   interleaved in rounds. No relay runs meanwhile: the row is the cost of
//!   staging. A third workload stages without `NOTIFY` (`--quiet`): PostgreSQL
//!   takes a lock on its notification queue at every commit that notifies,
//!   which serializes those commits, and the pair shows what that costs.
//!   (Without a write of its own to pipeline with, a stage is one round trip
//!   more: a fourth on a three-round-trip request.)
//! - **Relay**: events per second of one relay (`Relay::run`, its defaults:
//!   batches of 100, two in flight) draining pre-staged events to RabbitMQ,
//!   then to Kafka (tansu, started for that row; `bench-server outbox-drain
//!   [--kafka]`): from its start until every event is confirmed and marked
//!   sent; its process's CPU and PostgreSQL's per event, and PostgreSQL's
//!   execution time per event by statement; against the target of 10,000
//!   events/s. Before each, the same relay with one batch in flight, on a
//!   database of its own, as a reference row (not in the smoke run).
//! - **Lag**: while the relay runs in the same process, transactional
//!   charges at a fixed rate each stage one event (`bench-server
//!   outbox-lag`, in process, without HTTP); the lag is from a charge's
//!   commit to its event's broker confirm.
//!
//! Nothing is pinned, as in the PostgreSQL section.

use std::process::Command;
use std::time::Duration;

use idem_testkit::{TestKafka, TestRabbitMq};

use super::load::{Expect, Measured};
use super::postgres::{cluster, url};
use super::process::helper_json;
use super::report::{Figure, Ratio, Report, Row, Target};
use super::{Bench, Framework, KeySource, Workload, short_id};

/// The events a second one relay should publish, to either broker.
const RELAY_TARGET: f64 = 10_000.0;

/// Starts the broker and the cluster; runs every row; stops them.
pub(super) fn outbox(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let broker = TestRabbitMq::start().map_err(|e| e.to_string())?;
    let (cluster, port) = cluster(bench, "outbox,relay,relay_one,relay_kafka,relay_kafka_one")?;
    let amqp = broker.url();
    // The one-in-flight reference rows measure nothing new in the smoke run,
    // which checks that each part runs.
    let references = bench.settings.mode != "smoke";
    let outcome = staging(bench, report, &url(port, "outbox")).and_then(|staged| {
        let rabbitmq = |report: &mut Report, database: &str, in_flight| {
            relay(
                bench,
                report,
                &amqp,
                &url(port, database),
                None,
                staged,
                in_flight,
            )
        };
        if references {
            rabbitmq(report, "relay_one", Some(1))?;
        }
        rabbitmq(report, "relay", None)?;
        lag(bench, report, &amqp, &url(port, "relay"))?;
        let tansu = TestKafka::start().map_err(|e| e.to_string())?;
        let servers = tansu.servers();
        let kafka = |report: &mut Report, database: &str, in_flight| {
            let database = url(port, database);
            relay(
                bench,
                report,
                &amqp,
                &database,
                Some(&servers),
                staged,
                in_flight,
            )
        };
        if references {
            kafka(report, "relay_kafka_one", Some(1))?;
        }
        kafka(report, "relay_kafka", None)
    });
    cluster.finish(Duration::from_secs(30));
    drop(broker);
    outcome
}

/// Transactional first executions without and with an event staged, at each
/// concurrency; answers the slowest rate with an event staged.
fn staging(bench: &Bench, report: &mut Report, url: &str) -> Result<f64, String> {
    let mut slowest = f64::INFINITY;
    for &c in &bench.settings.pg_concurrencies {
        let pool = c.to_string();
        // Both handlers write a row of their own, as a charge does; the
        // staging one sends its event pipelined with that write.
        let transactional = [
            "--store",
            url,
            "--pool",
            &pool,
            "--transactional",
            "--write",
        ];
        let plain = bench.serve(Framework::Axum, &transactional, None)?;
        let staging = bench.serve(
            Framework::Axum,
            &[&transactional[..], &["--outbox"]].concat(),
            None,
        )?;
        let quiet = bench.serve(
            Framework::Axum,
            &[&transactional[..], &["--outbox", "--quiet"]].concat(),
            None,
        )?;
        let first = |server| Workload {
            server,
            path: "/layered",
            keys: KeySource::Fresh,
            expect: Expect::Executed,
        };
        let pooled =
            bench.interleaved(&[first(&plain), first(&staging), first(&quiet)], c, None)?;
        drop(plain);
        drop(staging);
        drop(quiet);
        let [without, with, without_notify] = <[Measured; 3]>::try_from(pooled)
            .map_err(|_| "three workloads, three results".to_owned())?;
        for (what, measured) in [
            ("", &without),
            (" + one outbox event staged", &with),
            (" + one outbox event staged without NOTIFY", &without_notify),
        ] {
            report.rows.push(Row::from_load(
                "outbox",
                format!(
                    "axum layered on PgStore transactional, a row written{what}, first execution"
                ),
                c,
                measured,
            ));
        }
        report.ratios.push(Ratio::new(
            format!("transactional first executions writing a row, with / without an outbox event pipelined with it, req/s (c={c})"),
            with.rps() / without.rps(),
            Target::AtLeast(0.9),
        ));
        report.ratios.push(Ratio::new(
            format!("the same, the event staged without NOTIFY (the relay polls), req/s (c={c})"),
            without_notify.rps() / without.rps(),
            Target::AtLeast(0.9),
        ));
        slowest = slowest.min(with.rps());
    }
    Ok(slowest)
}

/// One relay draining pre-staged events to RabbitMQ, or to Kafka at
/// `kafka`; its rate against the charges'.
fn relay(
    bench: &Bench,
    report: &mut Report,
    amqp: &str,
    database: &str,
    kafka: Option<&str>,
    charges: f64,
    in_flight: Option<usize>,
) -> Result<(), String> {
    let events = bench.settings.outbox_events;
    let mut command = outbox_command(bench, "outbox-drain", amqp, database);
    command.args(["--events", &events.to_string()]);
    if let Some(batches) = in_flight {
        command.args(["--batches-in-flight", &batches.to_string()]);
    }
    if let Some(servers) = kafka {
        command.args(["--kafka", servers]);
    }
    let (to, publisher) = match kafka {
        Some(_) => ("Kafka", "idem-kafka"),
        None => ("RabbitMQ", "idem-rabbitmq"),
    };
    let json = helper_json(command, Duration::from_secs(900))?;
    let seconds = json["seconds"]
        .as_f64()
        .ok_or_else(|| format!("outbox-drain answered no seconds: {json}"))?;
    let drained = Measured {
        requests: events as u64,
        answered: events as u64,
        seconds,
        run_seconds: seconds,
        server_cpu_seconds: json["cpu_seconds"].as_f64(),
        database_cpu_seconds: json["database_cpu_seconds"].as_f64(),
        ..Measured::default()
    };
    if kafka.is_none() {
        report.notes.push(format!(
            "outbox relay rows: req/s is events/s, one relay (batches of 100, two in flight \
             unless the row says otherwise, keys over 1,000 accounts) draining {events} \
             pre-staged events (each row on a database of its own) to RabbitMQ (a durable \
             queue, persistent messages, publisher confirms) or Kafka (one partition, \
             acks=all, the idempotent producer) until all are confirmed and marked sent; srv \
             is the relay's process"
        ));
    }
    let what = format!("relay (PgOutbox + {publisher} OutboxPublisher) to {to}");
    if let Some(batches) = in_flight {
        // A reference row: the relay with fewer batches in flight.
        report.rows.push(
            Row::from_load(
                "outbox",
                format!("{what}, {batches} batch(es) in flight"),
                1,
                &drained,
            )
            .without_latency(),
        );
        return Ok(());
    }
    report
        .rows
        .push(Row::from_load("outbox", what, 1, &drained).without_latency());
    if let Some(statements) = json["statements"].as_array().filter(|s| !s.is_empty()) {
        let shares: Vec<String> = statements
            .iter()
            .map(|statement| {
                format!(
                    "{:.1} us `{}` ({} calls)",
                    statement["us_per_event"].as_f64().unwrap_or(f64::NAN),
                    statement["query"].as_str().unwrap_or("?"),
                    statement["calls"]
                )
            })
            .collect();
        report.notes.push(format!(
            "relay to {to}: PostgreSQL's execution time per event by statement \
             (pg_stat_statements; planning, parsing and the protocol are outside it): {}",
            shares.join("; ")
        ));
    }
    report.ratios.push(
        Ratio::new(
            format!("one relay's events/s to {to} / 10,000 events/s, the relay's target"),
            drained.rps() / RELAY_TARGET,
            Target::AtLeast(1.0),
        )
        .note(format!(
            "{} publish(es) retried (each waits for its backoff, and its key with it)",
            json["retried"]
        )),
    );
    if charges.is_finite() {
        report.ratios.push(Ratio::new(
            format!(
                "one relay's events/s to {to} / transactional charges staging an event, req/s \
                 (slowest c)"
            ),
            drained.rps() / charges,
            Target::AtLeast(1.0),
        ));
    }
    Ok(())
}

/// The lag from commit to confirm under a fixed rate of charges.
fn lag(bench: &Bench, report: &mut Report, amqp: &str, database: &str) -> Result<(), String> {
    let settings = &bench.settings;
    let rate = settings.outbox_lag_rate;
    let mut command = outbox_command(bench, "outbox-lag", amqp, database);
    command
        .args(["--rate", &rate.to_string()])
        .args(["--warmup-ms", &settings.warmup.as_millis().to_string()])
        .args([
            "--duration-ms",
            &settings.outbox_lag.as_millis().to_string(),
        ]);
    let json = helper_json(command, Duration::from_secs(900))?;
    let events = json["events"].as_u64().unwrap_or_default();
    let seconds = json["seconds"].as_f64().unwrap_or_default();
    let measured = Measured {
        requests: events,
        answered: events,
        seconds,
        run_seconds: seconds,
        p50_ms: json["p50_ms"].as_f64().unwrap_or_default(),
        p99_ms: json["p99_ms"].as_f64().unwrap_or_default(),
        ..Measured::default()
    };
    report.rows.push(Row::from_load(
        "outbox",
        format!("lag from commit to broker confirm, {rate} charges/s, relay running"),
        1,
        &measured,
    ));
    report.figures.push(Figure {
        section: "outbox",
        what: format!("outbox lag p99, commit to broker confirm, {rate} transactional charges/s"),
        value: json["p99_ms"].as_f64().map(|ms| ms * 1e3),
        unit: "us",
        note: format!(
            "{events} events; p50 {:.2} ms, max {:.2} ms; {} publish(es) retried; \
             relay woken by NOTIFY",
            measured.p50_ms,
            json["max_ms"].as_f64().unwrap_or_default(),
            json["retried"],
        ),
    });
    Ok(())
}

/// `bench-server SUBCOMMAND` on a fresh queue.
fn outbox_command(bench: &Bench, subcommand: &str, amqp: &str, database: &str) -> Command {
    let mut command = Command::new(&bench.binaries.server);
    command
        .arg(subcommand)
        .args(["--amqp", amqp, "--database", database])
        .args(["--queue", &format!("bench-outbox-{}", short_id())]);
    command
}
