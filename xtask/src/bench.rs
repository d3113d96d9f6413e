//! `cargo xtask bench [--quick] [--only SECTION] [--out PATH]`: what idem costs per request,
//! against the two limits that bound it, side by side in one run.
//!
//! - **Overhead**: the same trivial POST handler (1 KiB JSON body), bare and
//!   behind the layer (in-memory store), on axum and actix-web: first executions
//!   (a new key each) and replays, at several concurrencies. The server runs as a
//!   process of its own (`bench-server`), pinned to one CPU with one worker; the
//!   load generator ([`load`]) runs on the other CPU.
//! - **PostgreSQL**: the layered route on `PgStore` against pgbench running the
//!   store's own statements ([`pgbench`]) at the same concurrency, on the same
//!   throwaway cluster. Transactional mode against the plain one, when built.
//! - **Memory**: bytes per record of the in-memory store; peak RSS of
//!   payments-axum (`--store memory`) under a storm of charges.
//! - **Cleanup**: rows deleted per second, and the p99 of live requests while
//!   it runs against without it.
//! - **Scaling**: throughput and p99 from 1 to 64 clients, and from 10^4 to
//!   10^6 stored records.
//!
//! Absolute figures drift on a shared machine; the ratios are what to read. Each
//! is printed with its target and whether it meets it; no target is asserted.
//! The table is written as JSON too (default `target/bench/bench.json`).

mod load;
mod pgbench;
mod process;
mod report;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use load::{Expect, Keys, Measured, Plan};
use process::{Background, Process, helper_json};
use report::{Figure, Ratio, Report, Row, Target};

use crate::shell::{self, cargo, workspace_root};

/// How long and how wide each part runs.
struct Settings {
    mode: &'static str,
    warmup: Duration,
    duration: Duration,
    /// Client counts of the overhead runs (the first one is the scaling base).
    concurrencies: Vec<usize>,
    /// Stored records of the scaling runs (in-memory store).
    record_counts: Vec<usize>,
    /// Client counts of the PostgreSQL runs.
    pg_concurrencies: Vec<usize>,
    /// Stored records of the PostgreSQL scaling runs (empty: skipped).
    pg_record_counts: Vec<u64>,
    /// pgbench runs whole seconds.
    pgbench_seconds: u64,
    memory_records: usize,
    storm: Duration,
    cleanup_rows: u64,
    /// Measure bare twice, before and after the layered runs, and pool both:
    /// drift of the machine then weighs on both sides alike.
    bracket: bool,
}

impl Settings {
    fn full() -> Self {
        Self {
            mode: "full",
            warmup: Duration::from_secs(1),
            duration: Duration::from_secs(5),
            concurrencies: vec![1, 4, 16, 64],
            record_counts: vec![10_000, 100_000, 1_000_000],
            pg_concurrencies: vec![1, 16, 64],
            pg_record_counts: vec![10_000, 100_000, 1_000_000],
            pgbench_seconds: 5,
            memory_records: 1_000_000,
            storm: Duration::from_secs(10),
            cleanup_rows: 1_000_000,
            bracket: true,
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
            storm: Duration::from_secs(2),
            cleanup_rows: 100_000,
            bracket: false,
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
    let mut out = workspace_root().join("target/bench/bench.json");
    let mut only: Option<String> = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => settings = Settings::quick(),
            "--out" => out = PathBuf::from(args.next().ok_or("--out takes a path")?),
            "--only" => only = Some(args.next().ok_or("--only takes a section")?.clone()),
            other => {
                return Err(format!(
                    "bench takes --quick, --only SECTION and --out PATH, not {other}"
                ));
            }
        }
    }
    let binaries = Binaries::build()?;
    let logs = workspace_root().join("target/bench/logs");
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
            "overhead and scaling: server on CPU 1 with 1 worker thread, load generator on CPU 0"
                .to_owned(),
        );
    } else {
        report
            .notes
            .push("no CPU pinning (taskset missing or a single CPU)".to_owned());
    }
    report.notes.push(
        "PostgreSQL, memory and cleanup: nothing pinned; server (2 workers), PostgreSQL and load share every CPU"
            .to_owned(),
    );

    let sections: [(&str, Section); 5] = [
        ("overhead", Bench::overhead),
        ("records", Bench::records),
        ("memory", Bench::memory),
        ("storm", Bench::storm),
        ("postgres", Bench::postgres),
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
        if let Err(error) = section(&bench, &mut report) {
            eprintln!("bench: {name} failed: {error}");
            report.failures.push(format!("{name}: {error}"));
        }
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

/// One part of the bench: adds its rows, figures and ratios to the report.
type Section = fn(&Bench, &mut Report) -> Result<(), String>;

/// The release binaries the bench starts.
struct Binaries {
    server: PathBuf,
    payments: PathBuf,
}

impl Binaries {
    fn build() -> Result<Self, String> {
        let args = [
            "build",
            "-q",
            "--release",
            "-p",
            "bench-server",
            "-p",
            "payments-axum",
        ];
        shell::run(&format!("cargo {}", args.join(" ")), &mut cargo(&args))?;
        let release = workspace_root().join("target/release");
        Ok(Self {
            server: release.join("bench-server"),
            payments: release.join("payments-axum"),
        })
    }
}

struct Bench {
    settings: Settings,
    binaries: Binaries,
    logs: PathBuf,
    pin: bool,
}

/// A bench server, bare and layered routes.
struct Server {
    process: Process,
    addr: std::net::SocketAddr,
    pinned: bool,
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

impl Bench {
    /// Starts `bench-server serve`; pinned to CPU 1 with one worker when `pinned`.
    fn serve(&self, framework: Framework, extra: &[&str], pinned: bool) -> Result<Server, String> {
        let pinned = pinned && self.pin;
        let mut command = if pinned {
            let mut command = Command::new("taskset");
            command.args(["-c", "1"]).arg(&self.binaries.server);
            command
        } else {
            Command::new(&self.binaries.server)
        };
        command
            .args(["serve", "--framework", framework.name()])
            .args(["--workers", if pinned { "1" } else { "2" }])
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
            pinned,
        })
    }

    fn plan(&self, server: &Server, path: &str, keys: Keys, expect: Expect, c: usize) -> Plan {
        Plan {
            addr: server.addr,
            path: path.to_owned(),
            headers: Vec::new(),
            body: request_body(),
            keys,
            concurrency: c,
            warmup: self.settings.warmup,
            duration: self.settings.duration,
            expect,
            cpu: server.pinned.then_some(0),
        }
    }

    /// Runs `plan` against `server` and answers what it measured and the
    /// server's CPU use (% of one core) over the run.
    fn measure(&self, server: &Server, plan: &Plan) -> Result<(Measured, Option<f64>), String> {
        let cpu_before = server.process.cpu_seconds();
        let started = Instant::now();
        let mut measured = load::run(&self.binaries.server, plan)?;
        let elapsed = started.elapsed().as_secs_f64();
        let used = match (cpu_before, server.process.cpu_seconds()) {
            (Some(before), Some(after)) => Some(after - before),
            _ => None,
        };
        measured.server_cpu_seconds = used;
        let cpu = used
            .filter(|_| elapsed > 0.0)
            .map(|used| used / elapsed * 100.0);
        if measured.requests == 0 {
            return Err(format!(
                "{} {}: no right answer ({})",
                plan.path,
                match plan.expect {
                    Expect::Executed => "executed",
                    Expect::Replayed => "replayed",
                    Expect::Success => "success",
                },
                measured.first_error.as_deref().unwrap_or("no error either")
            ));
        }
        Ok((measured, cpu))
    }

    /// Bare against layered, in-memory store, both frameworks, every concurrency.
    fn overhead(&self, report: &mut Report) -> Result<(), String> {
        let concurrencies = &self.settings.concurrencies;
        for framework in [Framework::Axum, Framework::Actix] {
            let name = framework.name();
            let mut first_by_c = Vec::new();
            for &c in concurrencies {
                let server = self.serve(framework, &["--store", "memory"], true)?;
                let run = uuid::Uuid::new_v4().simple().to_string();
                let bare_plan = self.plan(
                    &server,
                    "/bare",
                    Keys::Fresh(format!("b{run}")),
                    Expect::Executed,
                    c,
                );
                let (mut bare, mut bare_cpu) = self.measure(&server, &bare_plan)?;
                let (first, first_cpu) = self.measure(
                    &server,
                    &self.plan(
                        &server,
                        "/layered",
                        Keys::Fresh(format!("f{run}")),
                        Expect::Executed,
                        c,
                    ),
                )?;
                let (replay, replay_cpu) = self.measure(
                    &server,
                    &self.plan(
                        &server,
                        "/layered",
                        Keys::Replay {
                            prefix: format!("r{run}-"),
                            pool: REPLAY_POOL,
                        },
                        Expect::Replayed,
                        c,
                    ),
                )?;
                if self.settings.bracket {
                    let (again, again_cpu) = self.measure(&server, &bare_plan)?;
                    bare_cpu = average(bare_cpu, again_cpu);
                    bare = bare.pooled(again);
                }
                drop(server);
                report.rows.push(Row::from_load(
                    "overhead",
                    format!("{name} bare"),
                    c,
                    &bare,
                    bare_cpu,
                ));
                report.rows.push(Row::from_load(
                    "overhead",
                    format!("{name} layered, first execution"),
                    c,
                    &first,
                    first_cpu,
                ));
                report.rows.push(Row::from_load(
                    "overhead",
                    format!("{name} layered, replay"),
                    c,
                    &replay,
                    replay_cpu,
                ));
                report.ratios.push(Ratio::new(
                    format!("{name} first executions / bare, req/s (c={c})"),
                    first.rps() / bare.rps(),
                    Target::AtLeast(0.90),
                ));
                report.ratios.push(Ratio::new(
                    format!("{name} replays / bare, req/s (c={c})"),
                    replay.rps() / bare.rps(),
                    Target::AtLeast(1.00),
                ));
                for (what, layered) in [("first executions", &first), ("replays", &replay)] {
                    if let (Some(bare_cost), Some(cost)) = (
                        bare.server_micros_per_request(),
                        layered.server_micros_per_request(),
                    ) {
                        report.ratios.push(
                            Ratio::new(
                                format!("{name} {what} / bare, server CPU-bound req/s (c={c})"),
                                bare_cost / cost,
                                Target::None,
                            )
                            .note(format!(
                                "bare {bare_cost:.1} us of server CPU per request, layered {cost:.1} us"
                            )),
                        );
                    }
                }
                first_by_c.push((c, first));
            }
            if let (Some((low_c, low)), Some((high_c, high))) =
                (first_by_c.first(), first_by_c.last())
                && low_c != high_c
            {
                report.ratios.push(Ratio::new(
                    format!("{name} first executions, req/s at c={high_c} / c={low_c}"),
                    high.rps() / low.rps(),
                    Target::None,
                ));
                report.ratios.push(Ratio::new(
                    format!("{name} first executions, p99 at c={high_c} / c={low_c}"),
                    high.p99_ms / low.p99_ms.max(0.001),
                    Target::None,
                ));
            }
        }
        Ok(())
    }

    /// The layered route (axum, in-memory store) as the store fills up.
    fn records(&self, report: &mut Report) -> Result<(), String> {
        let c = 16;
        let mut by_records = Vec::new();
        for &records in &self.settings.record_counts {
            let prefill = records.to_string();
            let server = self.serve(
                Framework::Axum,
                &["--store", "memory", "--prefill", &prefill],
                true,
            )?;
            let run = uuid::Uuid::new_v4().simple().to_string();
            let (first, first_cpu) = self.measure(
                &server,
                &self.plan(
                    &server,
                    "/layered",
                    Keys::Fresh(format!("f{run}")),
                    Expect::Executed,
                    c,
                ),
            )?;
            let (replay, replay_cpu) = self.measure(
                &server,
                &self.plan(
                    &server,
                    "/layered",
                    Keys::Replay {
                        prefix: format!("r{run}-"),
                        pool: REPLAY_POOL,
                    },
                    Expect::Replayed,
                    c,
                ),
            )?;
            drop(server);
            let records = records as u64;
            report.rows.push(
                Row::from_load(
                    "records",
                    "axum layered, first execution",
                    c,
                    &first,
                    first_cpu,
                )
                .records(records),
            );
            report.rows.push(
                Row::from_load("records", "axum layered, replay", c, &replay, replay_cpu)
                    .records(records),
            );
            by_records.push((records, first, replay));
        }
        if let (Some((low_n, low_first, low_replay)), Some((high_n, high_first, high_replay))) =
            (by_records.first(), by_records.last())
            && low_n != high_n
        {
            let span = format!(
                "{} / {} records",
                report::thousands(*high_n),
                report::thousands(*low_n)
            );
            for (what, low, high) in [
                ("first executions", low_first, high_first),
                ("replays", low_replay, high_replay),
            ] {
                report.ratios.push(Ratio::new(
                    format!("in-memory {what}, req/s at {span}"),
                    high.rps() / low.rps(),
                    Target::None,
                ));
                report.ratios.push(Ratio::new(
                    format!("in-memory {what}, p99 at {span}"),
                    high.p99_ms / low.p99_ms.max(0.001),
                    Target::None,
                ));
            }
        }
        Ok(())
    }

    /// Bytes per record of the in-memory store.
    fn memory(&self, report: &mut Report) -> Result<(), String> {
        let records = self.settings.memory_records.to_string();
        let mut command = Command::new(&self.binaries.server);
        command.args(["memory", "--records", &records]);
        let answer = helper_json(command, Duration::from_secs(300))?;
        let n = answer["records"].as_u64().unwrap_or_default();
        report.figures.push(Figure {
            section: "memory",
            what: format!(
                "in-memory store, RSS growth per record ({} records)",
                report::thousands(n)
            ),
            value: answer["rss_bytes_per_record"].as_f64(),
            unit: "B",
            note: "200-byte bodies, UUID keys, 100 scopes, one header".to_owned(),
        });
        report.figures.push(Figure {
            section: "memory",
            what: "in-memory store, bytes counted per record (max_bytes accounting)".to_owned(),
            value: answer["counted_bytes_per_record"].as_f64(),
            unit: "B",
            note: "what MemoryStore::used_bytes() charges against max_bytes".to_owned(),
        });
        Ok(())
    }

    /// payments-axum on the in-memory store under a storm of charges.
    fn storm(&self, report: &mut Report) -> Result<(), String> {
        let dir =
            std::env::temp_dir().join(format!("idem-bench-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut command = Command::new(&self.binaries.payments);
        command
            .args(["--listen", "127.0.0.1:0", "--store", "memory"])
            .current_dir(&dir);
        let server = Process::start(
            command,
            "listening on http://",
            Duration::from_secs(30),
            &self.logs.join("payments-axum.log"),
        );
        let outcome = server.and_then(|server| {
            let addr = server
                .announced
                .parse()
                .map_err(|e| format!("payments-axum announced {:?}: {e}", server.announced))?;
            let idle = server.peak_rss();
            let c = 64;
            let plan = Plan {
                addr,
                path: "/accounts/storm-{w}/charges".to_owned(),
                headers: vec!["Authorization: Bearer storm".to_owned()],
                body: r#"{"amount":100,"currency":"EUR"}"#.to_owned(),
                keys: Keys::Fresh(format!("s{}", uuid::Uuid::new_v4().simple())),
                concurrency: c,
                warmup: Duration::ZERO,
                duration: self.settings.storm,
                expect: Expect::Success,
                cpu: None,
            };
            let measured = load::run(&self.binaries.server, &plan)?;
            Ok((idle, server.peak_rss(), measured))
        });
        let _ = std::fs::remove_dir_all(&dir);
        let (idle, peak, measured) = outcome?;
        report.rows.push(Row::from_load(
            "storm",
            "payments-axum charges, a new key each",
            64,
            &measured,
            None,
        ));
        report.figures.push(Figure {
            section: "storm",
            what: format!(
                "payments-axum --store memory, peak RSS after {} charges",
                report::thousands(measured.requests)
            ),
            value: peak.map(|bytes| bytes as f64 / (1024.0 * 1024.0)),
            unit: "MiB",
            note: format!(
                "{} MiB before the storm; 64 clients, {:.0} s",
                idle.map_or("?".to_owned(), |bytes| format!(
                    "{:.1}",
                    bytes as f64 / (1024.0 * 1024.0)
                )),
                self.settings.storm.as_secs_f64()
            ),
        });
        Ok(())
    }

    /// Everything on PostgreSQL: the layered route against pgbench, scaling by
    /// stored records, transactional mode, cleanup.
    fn postgres(&self, report: &mut Report) -> Result<(), String> {
        let pgbench = pgbench::binary().ok_or(
            "pgbench not found (apt-get install postgresql-contrib); PostgreSQL rows skipped",
        )?;
        let mut command = Command::new(&self.binaries.server);
        command.args(["cluster", "--databases", "bench,scaling,cleanup"]);
        let cluster = Process::start(
            command,
            "cluster ",
            Duration::from_secs(120),
            &self.logs.join("cluster.log"),
        )?;
        let port: u16 = cluster
            .announced
            .split(' ')
            .nth(1)
            .and_then(|port| port.parse().ok())
            .ok_or_else(|| format!("the cluster announced {:?}", cluster.announced))?;
        let url = |database: &str| format!("postgres://postgres@127.0.0.1:{port}/{database}");
        let outcome = self
            .pg_limit(report, &pgbench, port, &url("bench"))
            .and_then(|()| self.pg_records(report, &url("scaling")))
            .and_then(|()| self.cleanup(report, &url("cleanup")));
        cluster.finish(Duration::from_secs(30));
        outcome
    }

    /// The layered route on PgStore against pgbench, same statements, same clients.
    fn pg_limit(
        &self,
        report: &mut Report,
        pgbench: &Path,
        port: u16,
        url: &str,
    ) -> Result<(), String> {
        let mut command = Command::new(&self.binaries.server);
        command.args(["pg-statements", "--url", url]);
        let statements = helper_json(command, Duration::from_secs(60))?;
        let scripts = pgbench::Scripts::new(&statements, REPLAY_POOL)?;
        let database = url.rsplit('/').next().unwrap_or("bench");
        for &c in &self.settings.pg_concurrencies {
            let pool = c.to_string();
            let server = self.serve(Framework::Axum, &["--store", url, "--pool", &pool], false)?;
            let run = uuid::Uuid::new_v4().simple().to_string();
            let (first, first_cpu) = self.measure(
                &server,
                &self.plan(
                    &server,
                    "/layered",
                    Keys::Fresh(format!("f{run}")),
                    Expect::Executed,
                    c,
                ),
            )?;
            // Keys `0`..: the ones pgbench's replay script draws.
            let (replay, replay_cpu) = self.measure(
                &server,
                &self.plan(
                    &server,
                    "/layered",
                    Keys::Replay {
                        prefix: String::new(),
                        pool: REPLAY_POOL,
                    },
                    Expect::Replayed,
                    c,
                ),
            )?;
            drop(server);
            let transactional = self.pg_transactional(url, c, &run);
            let seconds = self.settings.pgbench_seconds;
            let bench_first = pgbench::run(
                pgbench,
                port,
                database,
                &scripts.first,
                &scripts.defines,
                c,
                seconds,
                &self.logs,
            )?;
            let bench_replay = pgbench::run(
                pgbench,
                port,
                database,
                &scripts.replay,
                &scripts.defines,
                c,
                seconds,
                &self.logs,
            )?;
            report.rows.push(Row::from_load(
                "postgres",
                "axum layered on PgStore, first execution",
                c,
                &first,
                first_cpu,
            ));
            report
                .rows
                .push(pgbench_row("pgbench: claim + complete", c, &bench_first));
            report.rows.push(Row::from_load(
                "postgres",
                "axum layered on PgStore, replay",
                c,
                &replay,
                replay_cpu,
            ));
            report.rows.push(pgbench_row(
                "pgbench: claim of a completed key",
                c,
                &bench_replay,
            ));
            report.ratios.push(Ratio::new(
                format!("PgStore first executions req/s / pgbench tps (c={c})"),
                first.rps() / bench_first.tps,
                Target::AtLeast(0.85),
            ));
            report.ratios.push(Ratio::new(
                format!("PgStore replays req/s / pgbench tps (c={c})"),
                replay.rps() / bench_replay.tps,
                Target::AtLeast(0.85),
            ));
            match transactional {
                Ok([(tx_first, tx_first_cpu), (tx_replay, tx_replay_cpu)]) => {
                    report.rows.push(Row::from_load(
                        "postgres",
                        "axum layered on PgStore transactional, first execution",
                        c,
                        &tx_first,
                        tx_first_cpu,
                    ));
                    report.rows.push(Row::from_load(
                        "postgres",
                        "axum layered on PgStore transactional, replay",
                        c,
                        &tx_replay,
                        tx_replay_cpu,
                    ));
                    report.ratios.push(Ratio::new(
                        format!("transactional / plain PgStore, first executions req/s (c={c})"),
                        tx_first.rps() / first.rps(),
                        Target::None,
                    ));
                    report.ratios.push(Ratio::new(
                        format!("transactional / plain PgStore, replays req/s (c={c})"),
                        tx_replay.rps() / replay.rps(),
                        Target::None,
                    ));
                }
                Err(error) => report.ratios.push(Ratio::missing(
                    format!("transactional / plain PgStore, req/s (c={c})"),
                    Target::None,
                    format!("not measured: {error}"),
                )),
            }
        }
        Ok(())
    }

    /// The layered route on PgStore in transactional mode: first executions and
    /// replays (of the keys the plain replays completed).
    fn pg_transactional(
        &self,
        url: &str,
        c: usize,
        run: &str,
    ) -> Result<[(Measured, Option<f64>); 2], String> {
        let pool = c.to_string();
        let server = self.serve(
            Framework::Axum,
            &["--store", url, "--pool", &pool, "--transactional"],
            false,
        )?;
        let first = self.measure(
            &server,
            &self.plan(
                &server,
                "/layered",
                Keys::Fresh(format!("t{run}")),
                Expect::Executed,
                c,
            ),
        )?;
        let replay = self.measure(
            &server,
            &self.plan(
                &server,
                "/layered",
                Keys::Replay {
                    prefix: String::new(),
                    pool: REPLAY_POOL,
                },
                Expect::Replayed,
                c,
            ),
        )?;
        Ok([first, replay])
    }

    /// The layered route on PgStore as the table fills up.
    fn pg_records(&self, report: &mut Report, url: &str) -> Result<(), String> {
        let c = 16;
        let mut stored = 0;
        let mut by_records = Vec::new();
        for &records in &self.settings.pg_record_counts {
            let mut command = Command::new(&self.binaries.server);
            command
                .args(["pg-fill", "--url", url, "--live"])
                .arg(records.saturating_sub(stored).to_string());
            helper_json(command, Duration::from_secs(600))?;
            stored = records;
            let pool = c.to_string();
            let server = self.serve(Framework::Axum, &["--store", url, "--pool", &pool], false)?;
            let run = uuid::Uuid::new_v4().simple().to_string();
            let (first, cpu) = self.measure(
                &server,
                &self.plan(
                    &server,
                    "/layered",
                    Keys::Fresh(format!("f{run}")),
                    Expect::Executed,
                    c,
                ),
            )?;
            drop(server);
            report.rows.push(
                Row::from_load(
                    "records",
                    "axum layered on PgStore, first execution",
                    c,
                    &first,
                    cpu,
                )
                .records(records),
            );
            by_records.push((records, first));
        }
        if let (Some((low_n, low)), Some((high_n, high))) = (by_records.first(), by_records.last())
            && low_n != high_n
        {
            let span = format!(
                "{} / {} rows",
                report::thousands(*high_n),
                report::thousands(*low_n)
            );
            report.ratios.push(Ratio::new(
                format!("PgStore first executions, req/s at {span}"),
                high.rps() / low.rps(),
                Target::None,
            ));
            report.ratios.push(Ratio::new(
                format!("PgStore first executions, p99 at {span}"),
                high.p99_ms / low.p99_ms.max(0.001),
                Target::None,
            ));
        }
        Ok(())
    }

    /// Expired rows deleted per second, and live requests' p99 meanwhile.
    fn cleanup(&self, report: &mut Report, url: &str) -> Result<(), String> {
        let c = 4;
        let rows = self.settings.cleanup_rows;
        let (batch, pause_ms) = (1_000, 10);
        let mut command = Command::new(&self.binaries.server);
        command
            .args(["pg-fill", "--url", url, "--expired"])
            .arg(rows.to_string());
        helper_json(command, Duration::from_secs(900))?;
        let server = self.serve(Framework::Axum, &["--store", url, "--pool", "8"], false)?;
        let run = uuid::Uuid::new_v4().simple().to_string();
        let baseline_plan = self.plan(
            &server,
            "/layered",
            Keys::Fresh(format!("a{run}")),
            Expect::Executed,
            c,
        );
        let (baseline, baseline_cpu) = self.measure(&server, &baseline_plan)?;

        let mut command = Command::new(&self.binaries.server);
        command
            .args(["cleanup", "--url", url])
            .args(["--batch", &batch.to_string()])
            .args(["--pause-ms", &pause_ms.to_string()]);
        let during_plan = Plan {
            keys: Keys::Fresh(format!("d{run}")),
            warmup: Duration::ZERO,
            duration: Duration::from_secs(900),
            ..baseline_plan
        };
        let during = load::start(&self.binaries.server, &during_plan)?;
        let answer = Background::start(command, false)
            .and_then(|sweep| sweep.answer(Duration::from_secs(900)));
        let during = during.stop()?;
        let answer = answer?;
        drop(server);
        let deleted = answer["deleted"].as_f64().unwrap_or_default();
        let seconds = answer["seconds"].as_f64().unwrap_or_default();
        let rate = if seconds > 0.0 {
            deleted / seconds
        } else {
            0.0
        };
        report.rows.push(Row::from_load(
            "cleanup",
            "axum layered on PgStore, first execution, no cleanup",
            c,
            &baseline,
            baseline_cpu,
        ));
        report.rows.push(Row::from_load(
            "cleanup",
            "axum layered on PgStore, first execution, during cleanup",
            c,
            &during,
            None,
        ));
        report.figures.push(Figure {
            section: "cleanup",
            what: format!("expired rows deleted per second ({} rows)", report::thousands(deleted as u64)),
            value: Some(rate),
            unit: "rows/s",
            note: format!(
                "Cleanup batch {batch}, pause {pause_ms} ms (the defaults); {seconds:.1} s, {} batches",
                answer["batches"]
            ),
        });
        report.ratios.push(
            Ratio::new(
                "cleanup rows/s / 100,000",
                rate / 100_000.0,
                Target::AtLeast(1.0),
            )
            .note(format!("{} rows/s", report::thousands(rate as u64))),
        );
        report.ratios.push(Ratio::new(
            format!("live p99 during cleanup / without (c={c})"),
            during.p99_ms / baseline.p99_ms.max(0.001),
            Target::AtMost(2.0),
        ));
        Ok(())
    }
}

fn pgbench_row(what: &str, c: usize, outcome: &pgbench::Outcome) -> Row {
    Row {
        section: "postgres",
        what: what.to_owned(),
        concurrency: c,
        records: None,
        rate: outcome.tps,
        p50_ms: outcome.p50_ms,
        p99_ms: outcome.p99_ms,
        server_cpu: None,
        server_micros: None,
        generator_cpu: None,
        errors: outcome.failed,
        first_error: None,
    }
}

fn average(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some((a + b) / 2.0),
        (a, b) => a.or(b),
    }
}
