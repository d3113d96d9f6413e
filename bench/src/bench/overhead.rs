//! The in-memory sections: the layer against the bare handler, by concurrency
//! and by stored records.

use super::load::{Expect, Measured};
use super::report::{Ratio, Report, Row, Target, thousands};
use super::{Bench, Framework, KeySource, Workload};

/// Where the in-memory server runs; the load generator takes the other CPU.
pub(super) const SERVER_CPU: usize = 1;
pub(super) const GENERATOR_CPU: usize = 0;

/// Bare against layered (in-memory store), both frameworks, every concurrency.
pub(super) fn overhead(bench: &Bench, report: &mut Report) -> Result<(), String> {
    for framework in [Framework::Axum, Framework::Actix] {
        let name = framework.name();
        let mut first_by_c = Vec::new();
        for &c in &bench.settings.concurrencies {
            let server = bench.serve(framework, &["--store", "memory"], Some(SERVER_CPU))?;
            let replay_prefix = format!("r{}-", uuid::Uuid::new_v4().simple());
            let workloads = [
                Workload {
                    server: &server,
                    path: "/bare",
                    keys: KeySource::Fresh,
                    expect: Expect::Executed,
                },
                Workload {
                    server: &server,
                    path: "/layered",
                    keys: KeySource::Fresh,
                    expect: Expect::Executed,
                },
                Workload {
                    server: &server,
                    path: "/layered",
                    keys: KeySource::Replay(replay_prefix),
                    expect: Expect::Replayed,
                },
            ];
            let [bare, first, replay]: [Measured; 3] = bench
                .interleaved(&workloads, c, Some(GENERATOR_CPU))?
                .try_into()
                .map_err(|_| "three workloads, three results".to_owned())?;
            drop(server);
            let rows = [
                ("bare", &bare),
                ("layered, first execution", &first),
                ("layered, replay", &replay),
            ];
            for (what, measured) in rows {
                report.rows.push(Row::from_load(
                    "overhead",
                    format!("{name} {what}"),
                    c,
                    measured,
                ));
            }
            for (what, layered, target) in [
                ("first executions", &first, 0.90),
                ("replays", &replay, 1.00),
            ] {
                report.ratios.push(Ratio::new(
                    format!("{name} {what} / bare, req/s (c={c})"),
                    layered.rps() / bare.rps(),
                    Target::AtLeast(target),
                ));
                if let (Some(bare_cost), Some(cost)) = (
                    bare.server_micros_per_request(),
                    layered.server_micros_per_request(),
                ) {
                    report.ratios.push(
                        Ratio::new(
                            format!("{name} {what} / bare, CPU-bound req/s (c={c})"),
                            bare_cost / cost,
                            Target::None,
                        )
                        .note(format!(
                            "added server CPU per request {:.1} us (bare {bare_cost:.1} us, layered {cost:.1} us)",
                            cost - bare_cost
                        )),
                    );
                }
            }
            first_by_c.push((c, first));
        }
        if let (Some((low_c, low)), Some((high_c, high))) = (first_by_c.first(), first_by_c.last())
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
pub(super) fn records(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let c = 16;
    let mut by_records = Vec::new();
    for &records in &bench.settings.record_counts {
        let prefill = records.to_string();
        let server = bench.serve(
            Framework::Axum,
            &["--store", "memory", "--prefill", &prefill],
            Some(SERVER_CPU),
        )?;
        let workloads = [
            Workload {
                server: &server,
                path: "/layered",
                keys: KeySource::Fresh,
                expect: Expect::Executed,
            },
            Workload {
                server: &server,
                path: "/layered",
                keys: KeySource::Replay(format!("r{}-", uuid::Uuid::new_v4().simple())),
                expect: Expect::Replayed,
            },
        ];
        let [first, replay]: [Measured; 2] = bench
            .interleaved(&workloads, c, Some(GENERATOR_CPU))?
            .try_into()
            .map_err(|_| "two workloads, two results".to_owned())?;
        drop(server);
        let records = records as u64;
        report.rows.push(
            Row::from_load("records", "axum layered, first execution", c, &first).records(records),
        );
        report
            .rows
            .push(Row::from_load("records", "axum layered, replay", c, &replay).records(records));
        by_records.push((records, first, replay));
    }
    if let (Some((low_n, low_first, low_replay)), Some((high_n, high_first, high_replay))) =
        (by_records.first(), by_records.last())
        && low_n != high_n
    {
        let span = format!("{} / {} records", thousands(*high_n), thousands(*low_n));
        for (what, low, high) in [
            ("first executions", low_first, high_first),
            ("replays", low_replay, high_replay),
        ] {
            scaling_ratios(report, &format!("in-memory {what}"), &span, low, high);
        }
    }
    Ok(())
}

/// Throughput, p99 and server CPU per request at `high` against `low`.
pub(super) fn scaling_ratios(
    report: &mut Report,
    what: &str,
    span: &str,
    low: &Measured,
    high: &Measured,
) {
    report.ratios.push(Ratio::new(
        format!("{what}, req/s at {span}"),
        high.rps() / low.rps(),
        Target::None,
    ));
    report.ratios.push(Ratio::new(
        format!("{what}, p99 at {span}"),
        high.p99_ms / low.p99_ms.max(0.001),
        Target::None,
    ));
    if let (Some(low_cost), Some(high_cost)) = (
        low.server_micros_per_request(),
        high.server_micros_per_request(),
    ) {
        report.ratios.push(
            Ratio::new(
                format!("{what}, server CPU per request at {span}"),
                high_cost / low_cost,
                Target::None,
            )
            .note(format!("{low_cost:.1} us, then {high_cost:.1} us")),
        );
    }
}
