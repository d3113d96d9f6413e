//! The PostgreSQL sections, on one throwaway cluster: the layered route on
//! `PgStore` against pgbench (and transactional mode against plain), scaling by
//! stored rows, and cleanup under live load.
//!
//! Nothing is pinned here: PostgreSQL, its client (the server and the load
//! generator, or pgbench) share the CPUs as the scheduler sees fit. Pinning the
//! database to one CPU and its client to the other looked fairer, but on this
//! virtual machine every cross-CPU wake-up is expensive, and pgbench (one round
//! trip at a time per connection, mostly idle) lost half its transactions per
//! second to them, which flattered the store's ratio.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::load::{self, Expect, Keys, Measured};
use super::overhead::scaling_ratios;
use super::pgbench::{self, PgBench, Scripts};
use super::process::{Background, Process, helper_json, postgres_cpu_seconds};
use super::report::{Figure, Ratio, Report, Row, Target, thousands};
use super::{Bench, Framework, KeySource, REPLAY_POOL, Server, Workload};

/// No CPU is pinned in these sections (see the module docs).
const UNPINNED: Option<usize> = None;

/// Starts the cluster, runs every PostgreSQL section, stops the cluster.
pub(super) fn postgres(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let pgbench = pgbench::binary()
        .ok_or("pgbench not found (apt-get install postgresql-contrib); PostgreSQL rows skipped")?;
    let (cluster, port) = cluster(bench, "bench,scaling,cleanup")?;
    let outcome = limit(bench, report, pgbench, port)
        .and_then(|()| records(bench, report, &url(port, "scaling")))
        .and_then(|()| cleanup(bench, report, &url(port, "cleanup")));
    cluster.finish(Duration::from_secs(30));
    outcome
}

/// Starts a throwaway cluster with `databases` (comma-separated); answers it
/// and its port. [`Process::finish`] stops it.
pub(super) fn cluster(bench: &Bench, databases: &str) -> Result<(Process, u16), String> {
    let mut command = bench.pinned(&bench.binaries.server, UNPINNED);
    command.args(["cluster", "--databases", databases]);
    let cluster = Process::start(
        command,
        "cluster ",
        Duration::from_secs(120),
        &bench.logs.join("cluster.log"),
    )?;
    let port: u16 = cluster
        .announced
        .split(' ')
        .nth(1)
        .and_then(|port| port.parse().ok())
        .ok_or_else(|| format!("the cluster announced {:?}", cluster.announced))?;
    Ok((cluster, port))
}

pub(super) fn url(port: u16, database: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/{database}")
}

/// Runs `workload` (unpinned) and measures the CPU time of the PostgreSQL
/// server on `port` meanwhile.
pub(super) fn with_database_cpu(
    bench: &Bench,
    workload: &Workload<'_>,
    c: usize,
    port: u16,
) -> Result<Measured, String> {
    let before = postgres_cpu_seconds(port);
    let mut measured = bench.run_workload(workload, c, UNPINNED)?;
    measured.database_cpu_seconds = before
        .zip(postgres_cpu_seconds(port))
        .map(|(before, after)| after - before);
    Ok(measured)
}

/// The layered route on PgStore against pgbench, same statements, same
/// clients; transactional mode against plain.
fn limit(
    bench: &Bench,
    report: &mut Report,
    pgbench: std::path::PathBuf,
    port: u16,
) -> Result<(), String> {
    let url = url(port, "bench");
    let mut command = Command::new(&bench.binaries.server);
    command.args(["pg-statements", "--url", &url]);
    let statements = helper_json(command, Duration::from_secs(60))?;
    let scripts = Scripts::new(&statements, REPLAY_POOL)?;
    let pgbench = PgBench {
        binary: pgbench,
        port,
        database: "bench".to_owned(),
        defines: scripts.defines.clone(),
        dir: bench.logs.clone(),
        cpu: UNPINNED,
    };
    let seconds = bench.settings.pgbench_seconds;
    for &c in &bench.settings.pg_concurrencies {
        let pool = c.to_string();
        let plain = bench.serve(
            Framework::Axum,
            &["--store", &url, "--pool", &pool],
            UNPINNED,
        )?;
        let transactional = bench.serve(
            Framework::Axum,
            &["--store", &url, "--pool", &pool, "--transactional"],
            UNPINNED,
        );
        let workload = |server: &Server, replay: bool| -> Result<(Measured, Counted), String> {
            let workload = Workload {
                server,
                path: "/layered",
                // Replays draw keys `0`.. : the ones pgbench's replay script draws.
                keys: if replay {
                    KeySource::Replay(String::new())
                } else {
                    KeySource::Fresh
                },
                expect: if replay {
                    Expect::Replayed
                } else {
                    Expect::Executed
                },
            };
            counted_run(bench, &workload, c, &pgbench.binary, port)
        };
        let mut first = Measured::default();
        let mut replay = Measured::default();
        let mut tx_first = Measured::default();
        let mut tx_replay = Measured::default();
        // Statements per answer: first, replay, transactional first, replay.
        let mut counted = [Counted::default(); 4];
        let mut bench_first = None::<pgbench::Outcome>;
        let mut bench_replay = None::<pgbench::Outcome>;
        let mut tx_error = transactional.as_ref().err().cloned();
        // Completed once before any round, so that each replay run's own
        // priming replays too, and its per-request figures are a replay's.
        prime(
            bench,
            &Workload {
                server: &plain,
                path: "/layered",
                keys: KeySource::Replay(String::new()),
                expect: Expect::Replayed,
            },
            c,
        )?;
        for _ in 0..bench.settings.rounds {
            let (run, count) = workload(&plain, false)?;
            first = first.pooled(run);
            counted[0] = counted[0].add(count);
            let run = pgbench.run(&scripts.first, c, seconds)?;
            bench_first = Some(match bench_first {
                Some(earlier) => earlier.pooled(run),
                None => run,
            });
            let (run, count) = workload(&plain, true)?;
            replay = replay.pooled(run);
            counted[1] = counted[1].add(count);
            let run = pgbench.run(&scripts.replay, c, seconds)?;
            bench_replay = Some(match bench_replay {
                Some(earlier) => earlier.pooled(run),
                None => run,
            });
            if let (Ok(server), None) = (&transactional, &tx_error) {
                match workload(server, false).and_then(|first| Ok((first, workload(server, true)?)))
                {
                    Ok(((first, first_count), (replay, replay_count))) => {
                        tx_first = tx_first.pooled(first);
                        tx_replay = tx_replay.pooled(replay);
                        counted[2] = counted[2].add(first_count);
                        counted[3] = counted[3].add(replay_count);
                    }
                    Err(error) => tx_error = Some(error),
                }
            }
        }
        drop(plain);
        drop(transactional);
        let (bench_first, bench_replay) = bench_first
            .zip(bench_replay)
            .ok_or("no pgbench round ran")?;
        report.rows.push(Row::from_load(
            "postgres",
            "axum layered on PgStore, first execution",
            c,
            &first,
        ));
        report
            .rows
            .push(pgbench_row("pgbench: claim + complete", c, &bench_first));
        report.rows.push(Row::from_load(
            "postgres",
            "axum layered on PgStore, replay",
            c,
            &replay,
        ));
        report.rows.push(pgbench_row(
            "pgbench: claim of a completed key",
            c,
            &bench_replay,
        ));
        report.ratios.push(Ratio::new(
            format!("PgStore first executions req/s / pgbench tps (c={c})"),
            first.rps() / bench_first.tps,
            Target::AtLeast(0.9),
        ));
        report.ratios.push(Ratio::new(
            format!("PgStore replays req/s / pgbench tps (c={c})"),
            replay.rps() / bench_replay.tps,
            Target::AtLeast(0.9),
        ));
        for (what, store, pgbench) in [
            ("first executions", &first, &bench_first),
            ("replays", &replay, &bench_replay),
        ] {
            if let (Some(store_cost), Some(pgbench_cost)) = (
                store.database_micros_per_request(),
                pgbench.database_micros_per_transaction(),
            ) {
                report.ratios.push(
                    Ratio::new(
                        format!("PgStore {what} / pgbench, database-bound req/s (c={c})"),
                        pgbench_cost / store_cost,
                        Target::None,
                    )
                    .note(format!(
                        "PostgreSQL CPU per request: store {store_cost:.1} us, pgbench {pgbench_cost:.1} us"
                    )),
                );
            }
        }
        let kinds = [
            ("first execution", "; goal 2"),
            ("replay", "; goal 1"),
            (
                "transactional first execution",
                " but for the pipelined ones; pg_stat_statements does not count the \
                 prepared COMMIT: 5 statements (read, BEGIN, claim, completion, COMMIT) \
                 in 3 round trips",
            ),
            ("transactional replay", "; goal 1"),
        ];
        for (index, ((what, floor), count)) in kinds.iter().zip(counted).enumerate() {
            if index >= 2 && tx_error.is_some() {
                continue;
            }
            report.figures.push(Figure {
                section: "postgres",
                what: format!("statements per PgStore {what} (c={c})"),
                value: count.per_answer(),
                unit: "statements",
                note: format!(
                    "pg_stat_statements calls / answers (warm-up included; the replay \
                     pool is completed before the runs), one round trip each{floor}"
                ),
            });
        }
        match tx_error {
            None => {
                report.rows.push(Row::from_load(
                    "postgres",
                    "axum layered on PgStore transactional, first execution",
                    c,
                    &tx_first,
                ));
                report.rows.push(Row::from_load(
                    "postgres",
                    "axum layered on PgStore transactional, replay",
                    c,
                    &tx_replay,
                ));
                report.ratios.push(Ratio::new(
                    format!("transactional / plain PgStore, first executions req/s (c={c})"),
                    tx_first.rps() / first.rps(),
                    Target::AtLeast(0.85),
                ));
                report.ratios.push(Ratio::new(
                    format!("transactional / plain PgStore, replays req/s (c={c})"),
                    tx_replay.rps() / replay.rps(),
                    Target::AtLeast(0.9),
                ));
            }
            Some(error) => report.ratios.push(Ratio::missing(
                format!("transactional / plain PgStore, req/s (c={c})"),
                Target::None,
                format!("not measured: {error}"),
            )),
        }
        replay_cache(bench, report, &url, c, &pgbench.binary, port)?;
    }
    Ok(())
}

/// Runs `workload` at `c` clients, with PostgreSQL's CPU time and the
/// statements it ran meanwhile.
fn counted_run(
    bench: &Bench,
    workload: &Workload<'_>,
    c: usize,
    pgbench: &Path,
    port: u16,
) -> Result<(Measured, Counted), String> {
    let statements_before = pgbench::statements_run(pgbench, port);
    let measured = with_database_cpu(bench, workload, c, port)?;
    let counted = Counted {
        statements: statements_before
            .zip(pgbench::statements_run(pgbench, port))
            .map(|(before, after)| after.saturating_sub(before)),
        answers: measured.answered,
    };
    Ok((measured, counted))
}

/// Completes the replay pool of `workload` (a short run whose priming does it),
/// so that the priming of the measured runs only replays.
fn prime(bench: &Bench, workload: &Workload<'_>, c: usize) -> Result<(), String> {
    let KeySource::Replay(prefix) = &workload.keys else {
        return Ok(());
    };
    let keys = Keys::Replay {
        prefix: prefix.clone(),
        pool: REPLAY_POOL,
    };
    let mut plan = bench.plan(workload.server, workload.path, keys, workload.expect, c);
    plan.warmup = Duration::ZERO;
    plan.duration = Duration::from_millis(50);
    load::run(&bench.binaries.server, &plan).map(drop)
}

/// Completed records a `ReplayCache` holds in the bench (the replay pool fits).
const REPLAY_CACHE_RECORDS: usize = 10 * REPLAY_POOL;

/// PgStore replays with a `ReplayCache` in front against in-memory replays, in
/// interleaved rounds. Both servers run as the other PostgreSQL rows do
/// (unpinned, 2 workers), so that the ratio compares like with like; the
/// in-memory rows of the overhead section are pinned to 1 worker.
fn replay_cache(
    bench: &Bench,
    report: &mut Report,
    url: &str,
    c: usize,
    pgbench: &Path,
    port: u16,
) -> Result<(), String> {
    let pool = c.to_string();
    let capacity = REPLAY_CACHE_RECORDS.to_string();
    let cached = bench.serve(
        Framework::Axum,
        &["--store", url, "--pool", &pool, "--replay-cache", &capacity],
        UNPINNED,
    )?;
    let memory = bench.serve(Framework::Axum, &["--store", "memory"], UNPINNED)?;
    // Fresh replay keys: the cache learns only the records its server
    // completes, so the priming must complete them through it.
    let replay = |server| Workload {
        server,
        path: "/layered",
        keys: KeySource::Replay(format!("cache-{}-", super::short_id())),
        expect: Expect::Replayed,
    };
    let (cached_workload, memory_workload) = (replay(&cached), replay(&memory));
    let mut cached_replay = Measured::default();
    let mut memory_replay = Measured::default();
    let mut counted = Counted::default();
    prime(bench, &memory_workload, c)?;
    prime(bench, &cached_workload, c)?;
    for _ in 0..bench.settings.rounds {
        let run = bench.run_workload(&memory_workload, c, UNPINNED)?;
        memory_replay = memory_replay.pooled(run);
        let (run, count) = counted_run(bench, &cached_workload, c, pgbench, port)?;
        cached_replay = cached_replay.pooled(run);
        counted = counted.add(count);
    }
    drop(cached);
    drop(memory);
    report.rows.push(Row::from_load(
        "postgres",
        "axum layered in memory (2 workers, unpinned), replay",
        c,
        &memory_replay,
    ));
    report.rows.push(Row::from_load(
        "postgres",
        "axum layered on PgStore + ReplayCache, replay",
        c,
        &cached_replay,
    ));
    report.ratios.push(Ratio::new(
        format!("PgStore + ReplayCache replays / in-memory replays, req/s (c={c})"),
        cached_replay.rps() / memory_replay.rps(),
        Target::AtLeast(0.9),
    ));
    report.figures.push(Figure {
        section: "postgres",
        what: format!("statements per PgStore + ReplayCache replay (c={c})"),
        value: counted.per_answer(),
        unit: "statements",
        note: "pg_stat_statements calls / answers; goal 0".to_owned(),
    });
    Ok(())
}

/// Statements the cluster ran during a workload, and the workload's answers.
#[derive(Clone, Copy, Default)]
struct Counted {
    /// `None` when `pg_stat_statements` could not be read.
    statements: Option<u64>,
    answers: u64,
}

impl Counted {
    fn add(self, other: Self) -> Self {
        let statements = if self.answers == 0 {
            other.statements
        } else {
            self.statements.zip(other.statements).map(|(a, b)| a + b)
        };
        Self {
            statements,
            answers: self.answers + other.answers,
        }
    }

    fn per_answer(self) -> Option<f64> {
        let statements = self.statements?;
        (self.answers > 0).then(|| statements as f64 / self.answers as f64)
    }
}

fn pgbench_row(what: &str, c: usize, outcome: &pgbench::Outcome) -> Row {
    Row {
        section: "postgres",
        what: what.to_owned(),
        concurrency: c,
        records: None,
        rate: outcome.tps,
        p50_ms: Some(outcome.p50_ms),
        p99_ms: Some(outcome.p99_ms),
        server_cpu: None,
        server_micros: None,
        generator_cpu: None,
        database_micros: outcome.database_micros_per_transaction(),
        errors: outcome.failed,
        first_error: None,
    }
}

/// The layered route on PgStore as the table fills up.
fn records(bench: &Bench, report: &mut Report, url: &str) -> Result<(), String> {
    let c = 16;
    let mut stored = 0;
    let mut by_records = Vec::new();
    for &records in &bench.settings.pg_record_counts {
        fill(bench, url, "--live", records.saturating_sub(stored))?;
        stored = records;
        let pool = c.to_string();
        let server = bench.serve(
            Framework::Axum,
            &["--store", url, "--pool", &pool],
            UNPINNED,
        )?;
        let workload = Workload {
            server: &server,
            path: "/layered",
            keys: KeySource::Fresh,
            expect: Expect::Executed,
        };
        let first = bench
            .interleaved(std::slice::from_ref(&workload), c, UNPINNED)?
            .pop()
            .ok_or("one workload, one result")?;
        drop(server);
        report.rows.push(
            Row::from_load(
                "records",
                "axum layered on PgStore, first execution",
                c,
                &first,
            )
            .records(records),
        );
        by_records.push((records, first));
    }
    if let (Some((low_n, low)), Some((high_n, high))) = (by_records.first(), by_records.last())
        && low_n != high_n
    {
        let span = format!("{} / {} rows", thousands(*high_n), thousands(*low_n));
        scaling_ratios(report, "PgStore first executions", &span, low, high);
    }
    Ok(())
}

/// Inserts `rows` completed records, `--live` or `--expired`.
fn fill(bench: &Bench, url: &str, kind: &str, rows: u64) -> Result<(), String> {
    let mut command = Command::new(&bench.binaries.server);
    command
        .args(["pg-fill", "--url", url, kind])
        .arg(rows.to_string());
    helper_json(command, Duration::from_secs(900)).map(drop)
}

/// The cleanup job's settings measured: (batch, shortest pause in ms, duty
/// cycle, label). The defaults; larger batches at the same duty cycle; a
/// gentler duty cycle.
const CLEANUP_SETTINGS: [(usize, u64, f64, &str); 3] = [
    (1_000, 1, 0.5, "the defaults: batch 1,000, 50 % duty cycle"),
    (5_000, 1, 0.5, "batches of 5,000, 50 % duty cycle"),
    (5_000, 1, 0.25, "batches of 5,000, 25 % duty cycle"),
];

/// One sweep of `rows` expired rows at a setting: deleted per second, and what
/// the job answered.
struct Sweep {
    rate: f64,
    deleted: u64,
    seconds: f64,
    batches: serde_json::Value,
}

impl Sweep {
    fn start(
        bench: &Bench,
        url: &str,
        (batch, pause_ms, duty): (usize, u64, f64),
    ) -> Result<Background, String> {
        let mut command = bench.pinned(&bench.binaries.server, UNPINNED);
        command
            .args(["cleanup", "--url", url])
            .args(["--batch", &batch.to_string()])
            .args(["--pause-ms", &pause_ms.to_string()])
            .args(["--duty", &duty.to_string()]);
        Background::start(command, false)
    }

    fn from_answer(answer: &serde_json::Value) -> Self {
        let deleted = answer["deleted"].as_f64().unwrap_or_default();
        let seconds = answer["seconds"].as_f64().unwrap_or_default();
        Self {
            rate: if seconds > 0.0 {
                deleted / seconds
            } else {
                0.0
            },
            deleted: deleted as u64,
            seconds,
            batches: answer["batches"].clone(),
        }
    }
}

/// Expired rows deleted per second with the database otherwise idle, and live
/// requests' p99 while the job sweeps under load (where it gives way).
fn cleanup(bench: &Bench, report: &mut Report, url: &str) -> Result<(), String> {
    let c = 4;
    let rows = bench.settings.cleanup_rows;
    let server = bench.serve(Framework::Axum, &["--store", url, "--pool", "8"], UNPINNED)?;
    let live = Workload {
        server: &server,
        path: "/layered",
        keys: KeySource::Fresh,
        expect: Expect::Executed,
    };
    for (batch, pause_ms, duty, label) in CLEANUP_SETTINGS {
        let setting = (batch, pause_ms, duty);
        let note = |sweep: &Sweep| {
            format!(
                "batch {batch}, pauses of at least {pause_ms} ms, duty {duty}; {:.1} s, {} batches",
                sweep.seconds, sweep.batches
            )
        };
        // Idle: the job alone.
        fill(bench, url, "--expired", rows)?;
        let idle = Sweep::from_answer(
            &Sweep::start(bench, url, setting)?.answer(Duration::from_secs(900))?,
        );
        report.figures.push(Figure {
            section: "cleanup",
            what: format!(
                "expired rows deleted per second, database idle, {label} ({} rows)",
                thousands(idle.deleted)
            ),
            value: Some(idle.rate),
            unit: "rows/s",
            note: note(&idle),
        });
        report.ratios.push(
            Ratio::new(
                format!("cleanup rows/s, database idle / 200,000 ({label})"),
                idle.rate / 200_000.0,
                Target::AtLeast(1.0),
            )
            .note(format!("{} rows/s", thousands(idle.rate as u64))),
        );
        // Under load: live first executions before, then during a sweep.
        fill(bench, url, "--expired", rows)?;
        let baseline = bench
            .interleaved(std::slice::from_ref(&live), c, UNPINNED)?
            .pop()
            .ok_or("one workload, one result")?;
        let mut plan = bench.plan(
            &server,
            "/layered",
            Keys::Fresh(super::short_id()),
            Expect::Executed,
            c,
        );
        plan.warmup = Duration::ZERO;
        plan.duration = Duration::from_secs(900);
        plan.cpu = UNPINNED;
        let cpu_before = server.process.cpu_seconds();
        let started = std::time::Instant::now();
        let during = load::start(&bench.binaries.server, &plan)?;
        let answer = Sweep::start(bench, url, setting)
            .and_then(|sweep| sweep.answer(Duration::from_secs(900)));
        let mut during = during.stop()?;
        during.run_seconds = started.elapsed().as_secs_f64();
        during.server_cpu_seconds = cpu_before
            .zip(server.process.cpu_seconds())
            .map(|(before, after)| after - before);
        let loaded = Sweep::from_answer(&answer?);
        report.rows.push(Row::from_load(
            "cleanup",
            format!("axum layered on PgStore, first execution, before cleanup ({label})"),
            c,
            &baseline,
        ));
        report.rows.push(Row::from_load(
            "cleanup",
            format!("axum layered on PgStore, first execution, during cleanup ({label})"),
            c,
            &during,
        ));
        report.figures.push(Figure {
            section: "cleanup",
            what: format!(
                "expired rows deleted per second, under live load, {label} ({} rows)",
                thousands(loaded.deleted)
            ),
            value: Some(loaded.rate),
            unit: "rows/s",
            note: note(&loaded),
        });
        report.ratios.push(Ratio::new(
            format!("live p99 during cleanup / before, c={c} ({label})"),
            during.p99_ms / baseline.p99_ms.max(0.001),
            Target::AtMost(1.5),
        ));
    }
    drop(server);
    Ok(())
}
