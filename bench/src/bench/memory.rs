//! Memory: bytes per record of the in-memory store, and the example's peak
//! resident set under a flood of charges.

use std::process::Command;
use std::time::Duration;

use super::Bench;
use super::load::{self, Expect, Keys, Plan};
use super::process::{Process, helper_json};
use super::report::{Figure, Report, Row, thousands};

/// Bytes per record of the in-memory store.
pub(super) fn memory(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let records = bench.settings.memory_records.to_string();
    let mut command = Command::new(&bench.binaries.server);
    command.args(["memory", "--records", &records]);
    let answer = helper_json(command, Duration::from_secs(300))?;
    let n = answer["records"].as_u64().unwrap_or_default();
    report.figures.push(Figure {
        section: "memory",
        what: format!(
            "in-memory store, RSS growth per record ({} records)",
            thousands(n)
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

/// payments-axum on the in-memory store under a flood of charges.
pub(super) fn rss(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("idem-bench-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut command = Command::new(&bench.binaries.payments);
    command
        .args(["--listen", "127.0.0.1:0", "--store", "memory"])
        .current_dir(&dir);
    let c = 64;
    let outcome = Process::start(
        command,
        "listening on http://",
        Duration::from_secs(30),
        &bench.logs.join("payments-axum.log"),
    )
    .and_then(|server| {
        let addr = server
            .announced
            .parse()
            .map_err(|e| format!("payments-axum announced {:?}: {e}", server.announced))?;
        let idle = server.peak_rss();
        let plan = Plan {
            addr,
            path: "/accounts/storm-{w}/charges".to_owned(),
            headers: vec!["Authorization: Bearer storm".to_owned()],
            body: r#"{"amount":100,"currency":"EUR"}"#.to_owned(),
            keys: Keys::Fresh(format!("s{}", uuid::Uuid::new_v4().simple())),
            concurrency: c,
            warmup: Duration::ZERO,
            duration: bench.settings.rss_load,
            expect: Expect::Success,
            cpu: None,
        };
        let measured = load::run(&bench.binaries.server, &plan)?;
        Ok((idle, server.peak_rss(), measured))
    });
    let _ = std::fs::remove_dir_all(&dir);
    let (idle, peak, measured) = outcome?;
    report.rows.push(Row::from_load(
        "rss",
        "payments-axum charges, a new key each",
        c,
        &measured,
    ));
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    report.figures.push(Figure {
        section: "rss",
        what: format!(
            "payments-axum --store memory, peak RSS after {} charges",
            thousands(measured.requests)
        ),
        value: peak.map(mib),
        unit: "MiB",
        note: format!(
            "{} MiB before the charges; {c} clients, {:.0} s; the ledger grows too",
            idle.map_or("?".to_owned(), |bytes| format!("{:.1}", mib(bytes))),
            bench.settings.rss_load.as_secs_f64()
        ),
    });
    Ok(())
}
