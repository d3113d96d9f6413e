//! The SQLite section: the layered route on `SqliteStore`, its handler
//! writing one row as a charge does, in transactional mode (the row and the
//! record's completion in one SQLite transaction: `bench-server serve
//! --transactional --write`) against the plain store (the row on its own,
//! then the completion: `--write`). First executions and replays, the four
//! workloads interleaved in rounds, each server on a file of its own in the
//! bench's log directory; nothing pinned.

use super::load::{Expect, Measured};
use super::report::{Ratio, Report, Row, Target};
use super::{Bench, Framework, KeySource, Workload, short_id};

/// Runs every row.
pub(super) fn sqlite(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let dir = bench.logs.join(format!("sqlite-{}", short_id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let outcome = rows(bench, report, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

fn rows(bench: &Bench, report: &mut Report, dir: &std::path::Path) -> Result<(), String> {
    for &c in &bench.settings.pg_concurrencies {
        // SQLite has one writer: more connections than that only wait.
        let pool = c.clamp(1, 8).to_string();
        let file =
            |name: &str| format!("sqlite://{}", dir.join(format!("{name}-{c}.db")).display());
        let (plain_url, transactional_url) = (file("plain"), file("transactional"));
        let plain = bench.serve(
            Framework::Axum,
            &["--store", &plain_url, "--pool", &pool, "--write"],
            None,
        )?;
        let transactional = bench.serve(
            Framework::Axum,
            &[
                "--store",
                &transactional_url,
                "--pool",
                &pool,
                "--transactional",
                "--write",
            ],
            None,
        )?;
        let first = |server| Workload {
            server,
            path: "/layered",
            keys: KeySource::Fresh,
            expect: Expect::Executed,
        };
        let replay = |server| Workload {
            server,
            path: "/layered",
            keys: KeySource::Replay(short_id()),
            expect: Expect::Replayed,
        };
        let pooled = bench.interleaved(
            &[
                first(&plain),
                first(&transactional),
                replay(&plain),
                replay(&transactional),
            ],
            c,
            None,
        )?;
        drop(plain);
        drop(transactional);
        let [first_plain, first_tx, replay_plain, replay_tx] = <[Measured; 4]>::try_from(pooled)
            .map_err(|_| "four workloads, four results".to_owned())?;
        for (what, measured) in [
            (
                "axum layered on SqliteStore, a row written on its own, first execution",
                &first_plain,
            ),
            (
                "axum layered on SqliteStore transactional, a row written in the request's transaction, first execution",
                &first_tx,
            ),
            ("axum layered on SqliteStore, replay", &replay_plain),
            (
                "axum layered on SqliteStore transactional, replay",
                &replay_tx,
            ),
        ] {
            report
                .rows
                .push(Row::from_load("sqlite", what, c, measured));
        }
        report.ratios.push(Ratio::new(
            format!(
                "transactional / plain SqliteStore, first executions writing a row, req/s (c={c})"
            ),
            first_tx.rps() / first_plain.rps(),
            Target::AtLeast(0.85),
        ));
        report.ratios.push(Ratio::new(
            format!("transactional / plain SqliteStore, replays req/s (c={c})"),
            replay_tx.rps() / replay_plain.rps(),
            Target::AtLeast(0.9),
        ));
    }
    Ok(())
}
