//! `cargo xtask bench [--quick] [--only SECTION] [--out PATH]`: what idem costs per request,
//! against the two limits that bound it, side by side in one run.
//!
//! - **Overhead**: the same trivial POST handler (1 KiB JSON body), bare and
//!   behind the layer (in-memory store), on axum and actix-web: first executions
//!   (a new key each) and replays, at several concurrencies. The server runs as a
//!   process of its own (`bench-server`), pinned to one CPU with one worker; the
//!   load generator (`bench-server load`, see [`load`]) runs on the other CPU.
//! - **PostgreSQL**: the layered route on `PgStore` against pgbench running the
//!   store's own statements ([`pgbench`]) at the same concurrency, on the same
//!   throwaway cluster, nothing pinned. Transactional mode against the plain
//!   one.
//! - **SQLite** ([`sqlite`]): the layered route on `SqliteStore`, its handler
//!   writing a row, in transactional mode against the plain store: first
//!   executions and replays.
//! - **Redis**: the layered route on `RedisStore` against the store's own
//!   scripts called without HTTP ([`redis`]) at the same concurrency, on the
//!   same throwaway `redis-server`: first executions and replays.
//! - **Consumers** ([`consumer`]): messages per second through idem-rabbitmq
//!   with the PostgreSQL and the SQLite inbox, each against a bare lapin
//!   consumer applying the same transaction without an inbox (same prefetch,
//!   concurrency 1 and 32), draining pre-published payments on a throwaway
//!   RabbitMQ node; the consumer's and PostgreSQL's CPU time per message.
//! - **Kafka** ([`consumer`] too): the same on Kafka (tansu), idem-kafka with
//!   each partition's offset in the effect's transaction against a bare
//!   rdkafka consumer with auto-commit.
//! - **SQS** ([`consumer`] too): the same on SQS (moto's server), idem-sqs
//!   against a bare aws-sdk-sqs receive, apply, delete loop; moto's cost per
//!   call in a note.
//! - **Backlog** ([`consumer`] too): each consumer's peak resident set
//!   draining a large backlog (100,000 messages; 100 in the smoke run) on RabbitMQ
//!   and on Kafka, published first by another process.
//! - **Instructions** ([`instructions`], quick and full runs): the
//!   instructions each consumer process executes per message under
//!   callgrind, idem's one at a time and in batches of 128 against the bare
//!   consumer, on RabbitMQ and Kafka.
//! - **Outbox** ([`outbox`]): transactional first executions on `PgStore`
//!   with and without staging one outbox event in the request's transaction;
//!   one relay's events per second draining pre-staged events to a throwaway
//!   RabbitMQ node with idem-rabbitmq's `OutboxPublisher`; and the lag p99
//!   from a charge's commit to its event's broker confirm under a fixed rate
//!   of transactional charges.
//! - **Memory**: bytes per record of the in-memory store; (section `rss`)
//!   peak RSS of payments-axum (`--store memory`) under a flood of charges.
//! - **Storm** ([`storm`], also `cargo xtask storm`): 100 clients whose
//!   charges fail at once (the provider behind payments-axum down for 2 s),
//!   retrying through idem-client by four strategies side by side: the
//!   requests per 10 ms at the server, the time until every charge
//!   succeeded, the clients' latency, charges applied twice; a terminal
//!   chart, and an SVG (`target/bench/storm.svg`).
//! - **Cleanup**: rows deleted per second with the database otherwise idle,
//!   and the p99 of live requests while it sweeps under load against without
//!   it.
//! - **Scaling**: throughput and p99 from 1 to 64 clients, and from 10^4 to
//!   10^6 stored records.
//! - **Peers** ([`peers`], full mode only): published middleware, each a small
//!   server of its own under `bench/peers/` built into `target/bench/peers`,
//!   with the same handler and load, interleaved with idem's layered route:
//!   axum-idempotent 0.6 on ruts' session stores (in memory at c = 16 and 64,
//!   on PostgreSQL at c = 1 and 16), cratestack-axum 0.8 (sqlx, PostgreSQL)
//!   against `PgStore` at c = 1 and 16; and whether each ran its handler once
//!   under 50 parallel duplicates of one new key. `bench/peers/README.md` says
//!   how each is configured.
//!
//! Absolute figures drift on a shared machine; the ratios are what to read. The
//! workloads compared in a ratio run interleaved, in rounds, and each row pools
//! its rounds, so that drift weighs on both sides alike. Every row also shows
//! the server's CPU time per request, which contention does not inflate the way
//! it does latency. Each ratio is printed with its target and whether it meets
//! it; no target is asserted.
//! The table is written as JSON too (default `target/bench/bench.json`).

mod consumer;
mod instructions;
mod load;
mod memory;
mod outbox;
mod overhead;
mod peers;
mod pgbench;
mod postgres;
mod process;
mod redis;
mod report;
mod sqlite;
mod storm;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use load::{Expect, Keys, Measured, Plan};
use process::Process;
use report::Report;

use idem_testkit::shell::{Profile, target_dir};

/// How long and how wide each part runs.
struct Settings {
    mode: &'static str,
    warmup: Duration,
    duration: Duration,
    /// Client counts of the overhead runs (the first one is the scaling base).
    concurrencies: Vec<usize>,
    /// Stored records of the scaling runs (in-memory store).
    record_counts: Vec<usize>,
    /// Client counts of the PostgreSQL and Redis runs.
    pg_concurrencies: Vec<usize>,
    /// Stored records of the PostgreSQL scaling runs (empty: skipped).
    pg_record_counts: Vec<u64>,
    /// pgbench runs whole seconds.
    pgbench_seconds: u64,
    memory_records: usize,
    /// How long the charges run whose peak RSS the rss section reads.
    rss_load: Duration,
    /// The retry storm (the storm section): clients failing at once.
    storm_clients: usize,
    /// How long the provider fails at the storm's start.
    storm_outage: Duration,
    /// The first retry's bound of the exponential strategies.
    storm_base: Duration,
    cleanup_rows: u64,
    /// Rounds of interleaved runs pooled into each row.
    rounds: usize,
    /// Consumers' concurrencies (the consumer section).
    consumer_concurrencies: Vec<usize>,
    /// Kafka consumers' concurrencies: the topic's partitions (the kafka
    /// section).
    kafka_concurrencies: Vec<usize>,
    /// SQS consumers' concurrencies (the sqs section).
    sqs_concurrencies: Vec<usize>,
    /// Messages each SQS run drains, measured (moto serves a few hundred
    /// calls a second).
    sqs_messages: usize,
    /// Messages each SQS run drains first, unmeasured.
    sqs_warmup: usize,
    /// Messages each consumer run drains, measured.
    consumer_messages: usize,
    /// Messages each consumer run drains first, unmeasured.
    consumer_warmup: usize,
    /// The rounds of each consumer row (idem and bare, alternating): the
    /// row shows their median, so that one slow drain does not swing it.
    consumer_rounds: usize,
    /// The batch sizes of the consumer and kafka sections' batch rows.
    consumer_batches: Vec<usize>,
    /// The backlog each consumer drains in the backlog section.
    backlog_messages: usize,
    /// The two drains whose difference counts a message's instructions
    /// (the instructions section).
    instruction_messages: (usize, usize),
    /// Events the outbox's relay drains (the outbox section).
    outbox_events: usize,
    /// Transactional charges a second while the outbox's lag is measured.
    outbox_lag_rate: u32,
    /// How long the outbox's lag is measured.
    outbox_lag: Duration,
}

impl Settings {
    fn full() -> Self {
        Self {
            mode: "full",
            warmup: Duration::from_millis(500),
            duration: Duration::from_secs(2),
            concurrencies: vec![1, 4, 16, 64],
            record_counts: vec![10_000, 100_000, 1_000_000],
            pg_concurrencies: vec![1, 16, 64],
            pg_record_counts: vec![10_000, 100_000, 1_000_000],
            pgbench_seconds: 2,
            memory_records: 1_000_000,
            rss_load: Duration::from_secs(10),
            storm_clients: 100,
            storm_outage: Duration::from_secs(2),
            storm_base: Duration::from_secs(1),
            cleanup_rows: 1_000_000,
            rounds: 3,
            consumer_concurrencies: vec![1, 32],
            kafka_concurrencies: vec![1, 4],
            sqs_concurrencies: vec![1, 10],
            sqs_messages: 2_000,
            sqs_warmup: 100,
            consumer_messages: 10_000,
            consumer_warmup: 256,
            consumer_rounds: 3,
            consumer_batches: vec![1, 16, 128],
            backlog_messages: 100_000,
            instruction_messages: (200, 2_200),
            outbox_events: 100_000,
            outbox_lag_rate: 200,
            outbox_lag: Duration::from_secs(10),
        }
    }

    fn quick() -> Self {
        Self {
            mode: "quick",
            warmup: Duration::from_millis(200),
            duration: Duration::from_millis(800),
            concurrencies: vec![16],
            record_counts: vec![10_000, 100_000],
            pg_concurrencies: vec![8],
            pg_record_counts: Vec::new(),
            pgbench_seconds: 1,
            memory_records: 100_000,
            rss_load: Duration::from_secs(2),
            storm_clients: 100,
            storm_outage: Duration::from_secs(2),
            storm_base: Duration::from_secs(1),
            cleanup_rows: 100_000,
            rounds: 1,
            consumer_concurrencies: vec![1, 32],
            kafka_concurrencies: vec![1, 4],
            sqs_concurrencies: vec![1, 10],
            sqs_messages: 200,
            sqs_warmup: 20,
            // Drains of one to three seconds: with 1,000 messages two quick
            // runs' consumer ratios differed by up to 23 %.
            consumer_messages: 3_000,
            consumer_warmup: 64,
            // Five rounds left two quick runs' ratios up to 17 % apart on
            // some rows (the machine's speed moves between runs by a
            // quarter; each ratio pairs adjacent drains, yet not perfectly).
            consumer_rounds: 7,
            consumer_batches: vec![1, 16, 128],
            backlog_messages: 100_000,
            instruction_messages: (100, 600),
            outbox_events: 20_000,
            outbox_lag_rate: 200,
            outbox_lag: Duration::from_secs(2),
        }
    }

    /// CI's check that every section runs, end to end, on the dev build:
    /// the least work each part can do and still pass through every step
    /// (a few seconds a section, most of it starting servers). Measures
    /// nothing.
    fn smoke() -> Self {
        Self {
            mode: "smoke",
            warmup: Duration::from_millis(50),
            duration: Duration::from_millis(200),
            concurrencies: vec![4],
            record_counts: vec![1_000],
            pg_concurrencies: vec![4],
            memory_records: 10_000,
            rss_load: Duration::from_millis(500),
            storm_clients: 20,
            storm_outage: Duration::from_millis(200),
            storm_base: Duration::from_millis(100),
            cleanup_rows: 2_000,
            // One concurrency each: every step of the section runs (a
            // Kafka group's join alone takes seconds on tansu).
            consumer_concurrencies: vec![4],
            kafka_concurrencies: vec![2],
            sqs_concurrencies: vec![2],
            sqs_messages: 20,
            sqs_warmup: 4,
            consumer_messages: 40,
            consumer_warmup: 8,
            consumer_rounds: 1,
            consumer_batches: vec![128],
            backlog_messages: 100,
            outbox_events: 200,
            outbox_lag_rate: 50,
            outbox_lag: Duration::from_millis(500),
            // One round, pgbench's second, no PostgreSQL scaling: as quick.
            ..Self::quick()
        }
    }
}

/// The request body of the overhead and PostgreSQL runs: 1 KiB of JSON.
fn request_body() -> String {
    let prefix = r#"{"amount":100,"currency":"EUR","description":""#;
    let suffix = r#""}"#;
    let filler = "x".repeat(1024 - prefix.len() - suffix.len());
    format!("{prefix}{filler}{suffix}")
}

/// The replay keys' pool: `0` to `REPLAY_POOL - 1` (pgbench draws from it too).
const REPLAY_POOL: usize = 1_000;

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut settings = Settings::full();
    let mut out = target_dir().join("bench/bench.json");
    let mut only: Option<String> = None;
    let mut args = args.to_vec();
    let profile = Profile::take_from(&mut args, Profile::Release);
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => settings = Settings::quick(),
            "--smoke" => settings = Settings::smoke(),
            "--out" => out = PathBuf::from(args.next().ok_or("--out takes a path")?),
            "--only" => only = Some(args.next().ok_or("--only takes a section")?.clone()),
            other => {
                return Err(format!(
                    "bench takes --quick, --smoke, --dev, --only SECTION and --out PATH, not {other}"
                ));
            }
        }
    }
    if profile == Profile::Dev {
        report_dev_build();
    }
    let binaries = Binaries::build(profile)?;
    let logs = target_dir().join("bench/logs");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
    let bench = Bench {
        settings,
        binaries,
        logs,
        pin: std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2) && process::can_pin(),
    };
    let started = Instant::now();
    let load_before = process::load_average();
    let mut report = Report::default();
    if bench.pin {
        report.notes.push(
            "in-memory rows: server on CPU 1 (1 worker thread), load generator on CPU 0".to_owned(),
        );
        report.notes.push(
            "PostgreSQL rows: nothing pinned; server (2 workers), load generator or pgbench, and PostgreSQL share both CPUs"
                .to_owned(),
        );
        report.notes.push(
            "Redis rows: nothing pinned; server (2 workers), load generator or redis-load, and redis-server share both CPUs"
                .to_owned(),
        );
    } else {
        report.notes.push(
            "no CPU pinning (taskset missing or a single CPU): servers run 2 worker threads"
                .to_owned(),
        );
    }
    report.notes.push(format!(
        "each row pools {} interleaved round(s) of {:.1} s (after {:.1} s of warm-up each)",
        bench.settings.rounds,
        bench.settings.duration.as_secs_f64(),
        bench.settings.warmup.as_secs_f64(),
    ));

    let sections: [(&str, Section); 15] = [
        ("overhead", overhead::overhead),
        ("records", overhead::records),
        ("memory", memory::memory),
        ("rss", memory::rss),
        ("storm", storm::storm),
        ("postgres", postgres::postgres),
        ("sqlite", sqlite::sqlite),
        ("redis", redis::redis),
        ("consumer", consumer::consumer),
        ("kafka", consumer::kafka),
        ("sqs", consumer::sqs),
        ("backlog", consumer::backlog),
        ("instructions", instructions::instructions),
        ("outbox", outbox::outbox),
        ("peers", peers::peers),
    ];
    if let Some(only) = &only
        && !sections.iter().any(|(name, _)| name == only)
    {
        let names: Vec<&str> = sections.iter().map(|(name, _)| *name).collect();
        return Err(format!("no section {only}; sections: {}", names.join(", ")));
    }
    for (name, section) in sections {
        if only.as_ref().is_some_and(|only| only != name) {
            continue;
        }
        eprintln!("==> bench: {name}");
        let section_started = Instant::now();
        if let Err(error) = section(&bench, &mut report) {
            eprintln!("bench: {name} failed: {error}");
            report.failures.push(format!("{name}: {error}"));
        }
        eprintln!(
            "==> bench: {name}: {:.1} s",
            section_started.elapsed().as_secs_f64()
        );
    }
    let load_after = process::load_average();
    report.notes.push(format!(
        "machine: {} CPUs; 1-minute load average {} before, {} after; {:.0} s",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before.map_or("?".to_owned(), |l| format!("{l:.2}")),
        load_after.map_or("?".to_owned(), |l| format!("{l:.2}")),
        started.elapsed().as_secs_f64(),
    ));
    let title = format!("idem bench ({})", bench.settings.mode);
    print!("\n{}", report.render(&title));
    let json = report.to_json(bench.settings.mode);
    let text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
    process::write_file(&out, &text)?;
    println!("\nwritten to {}", out.display());
    if report.failures.is_empty() {
        Ok(())
    } else {
        Err(format!("{} bench section(s) failed", report.failures.len()))
    }
}

/// A short random prefix: 8 hex digits.
fn short_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

/// One part of the bench: adds its rows, figures and ratios to the report.
type Section = fn(&Bench, &mut Report) -> Result<(), String>;

/// The binaries the bench starts: release builds, or with `--dev` (CI's
/// smoke run) the workspace's dev build.
struct Binaries {
    server: PathBuf,
    payments: PathBuf,
}

impl Binaries {
    fn build(profile: Profile) -> Result<Self, String> {
        let dir = profile.build(&["bench-server", "payments-axum"])?;
        Ok(Self {
            server: dir.join("bench-server"),
            payments: dir.join("payments-axum"),
        })
    }
}

/// Says, before anything runs, that the figures of a dev build measure
/// nothing: `--dev` checks that every part of the bench runs (CI's smoke run).
fn report_dev_build() {
    eprintln!(
        "bench --dev: unoptimized binaries; the figures below check that each part runs, \
         they are not measurements"
    );
}

/// What every section works with.
struct Bench {
    settings: Settings,
    binaries: Binaries,
    logs: PathBuf,
    /// Whether processes are pinned to CPUs (two CPUs or more, and `taskset`).
    pin: bool,
}

/// A running `bench-server serve` (`/bare` and `/layered`), or a peer.
struct Server {
    process: Process,
    addr: std::net::SocketAddr,
    /// Header lines every load run sends it (a peer's session cookie).
    headers: Vec<String>,
}

#[derive(Clone, Copy, Debug)]
enum Framework {
    Axum,
    Actix,
}

impl Framework {
    fn name(self) -> &'static str {
        match self {
            Self::Axum => "axum",
            Self::Actix => "actix",
        }
    }
}

/// One workload of an interleaved comparison.
struct Workload<'a> {
    server: &'a Server,
    path: &'static str,
    keys: KeySource,
    expect: Expect,
}

/// Where a workload's keys come from.
#[derive(Clone)]
enum KeySource {
    /// New keys, under a fresh prefix every round.
    Fresh,
    /// The replay pool under this prefix (primed before each round).
    Replay(String),
}

impl Bench {
    /// Starts `bench-server serve`, pinned to `cpu` with one worker thread,
    /// or with two unpinned.
    fn serve(
        &self,
        framework: Framework,
        extra: &[&str],
        cpu: Option<usize>,
    ) -> Result<Server, String> {
        let cpu = cpu.filter(|_| self.pin);
        let mut command = self.pinned(&self.binaries.server, cpu);
        command
            .args(["serve", "--framework", framework.name()])
            .args(["--workers", if cpu.is_some() { "1" } else { "2" }])
            .args(extra);
        let process = Process::start(
            command,
            "listening on http://",
            Duration::from_secs(300),
            &self.logs.join("bench-server.log"),
        )?;
        let addr = process
            .announced
            .parse()
            .map_err(|e| format!("bench-server announced {:?}: {e}", process.announced))?;
        Ok(Server {
            process,
            addr,
            headers: Vec::new(),
        })
    }

    /// `binary`, under `taskset -c CPU` when pinned.
    fn pinned(&self, binary: &Path, cpu: Option<usize>) -> Command {
        match cpu.filter(|_| self.pin) {
            Some(cpu) => {
                let mut command = Command::new("taskset");
                command.args(["-c", &cpu.to_string()]).arg(binary);
                command
            }
            None => Command::new(binary),
        }
    }

    fn plan(&self, server: &Server, path: &str, keys: Keys, expect: Expect, c: usize) -> Plan {
        Plan {
            addr: server.addr,
            path: path.to_owned(),
            headers: server.headers.clone(),
            body: request_body(),
            keys,
            concurrency: c,
            warmup: self.settings.warmup,
            duration: self.settings.duration,
            expect,
            cpu: None,
        }
    }

    /// Runs `plan` against `server`; the answer carries the server's CPU time.
    fn measure(&self, server: &Server, plan: &Plan) -> Result<Measured, String> {
        let cpu_before = server.process.cpu_seconds();
        let started = Instant::now();
        let mut measured = load::run(&self.binaries.server, plan)?;
        measured.run_seconds = started.elapsed().as_secs_f64();
        measured.server_cpu_seconds = match (cpu_before, server.process.cpu_seconds()) {
            (Some(before), Some(after)) => Some(after - before),
            _ => None,
        };
        if measured.requests == 0 {
            return Err(format!(
                "{} {:?}: no right answer ({})",
                plan.path,
                plan.expect,
                measured.first_error.as_deref().unwrap_or("no error either")
            ));
        }
        Ok(measured)
    }

    /// Runs `workloads` one after the other, `rounds` times, and pools each
    /// workload's rounds. The load generator is pinned to `generator_cpu`.
    fn interleaved(
        &self,
        workloads: &[Workload<'_>],
        c: usize,
        generator_cpu: Option<usize>,
    ) -> Result<Vec<Measured>, String> {
        let mut pooled = vec![Measured::default(); workloads.len()];
        for _ in 0..self.settings.rounds {
            for (workload, total) in workloads.iter().zip(pooled.iter_mut()) {
                let measured = self.run_workload(workload, c, generator_cpu)?;
                *total = std::mem::take(total).pooled(measured);
            }
        }
        Ok(pooled)
    }

    fn run_workload(
        &self,
        workload: &Workload<'_>,
        c: usize,
        generator_cpu: Option<usize>,
    ) -> Result<Measured, String> {
        let keys = match &workload.keys {
            KeySource::Fresh => Keys::Fresh(short_id()),
            KeySource::Replay(prefix) => Keys::Replay {
                prefix: prefix.clone(),
                pool: REPLAY_POOL,
            },
        };
        let mut plan = self.plan(workload.server, workload.path, keys, workload.expect, c);
        plan.cpu = generator_cpu.filter(|_| self.pin);
        self.measure(workload.server, &plan)
    }
}
