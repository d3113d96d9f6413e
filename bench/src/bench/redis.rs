//! The Redis section: the layered route on `RedisStore` against the store's own
//! scripts called directly (`bench-server redis-load`: the same claim and
//! complete calls, no HTTP) at the same concurrency, on the same throwaway
//! `redis-server`; first executions and replays. Nothing is pinned, as in the
//! PostgreSQL section: Redis, the server and the load share both CPUs.

use std::process::Command;
use std::time::Duration;

use idem_testkit::TestRedis;

use super::load::{Expect, Measured};
use super::process::helper_json;
use super::report::{Ratio, Report, Row, Target};
use super::{Bench, Framework, KeySource, Workload, short_id};

/// Starts a node, measures, stops it.
pub(super) fn redis(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let node = TestRedis::start().map_err(|e| e.to_string())?;
    let url = node.url();
    for &c in &bench.settings.pg_concurrencies {
        let server = bench.serve(Framework::Axum, &["--store", &url], None)?;
        let mut first = Measured::default();
        let mut replay = Measured::default();
        let mut direct_first = Measured::default();
        let mut direct_replay = Measured::default();
        for _ in 0..bench.settings.rounds {
            let route = |keys, expect| Workload {
                server: &server,
                path: "/layered",
                keys,
                expect,
            };
            first = first.pooled(bench.run_workload(
                &route(KeySource::Fresh, Expect::Executed),
                c,
                None,
            )?);
            direct_first = direct_first.pooled(direct(bench, &url, c, "first")?);
            replay = replay.pooled(bench.run_workload(
                &route(KeySource::Replay(short_id()), Expect::Replayed),
                c,
                None,
            )?);
            direct_replay = direct_replay.pooled(direct(bench, &url, c, "replay")?);
        }
        drop(server);
        for (what, route, direct) in [
            ("first execution", &first, &direct_first),
            ("replay", &replay, &direct_replay),
        ] {
            report.rows.push(Row::from_load(
                "redis",
                format!("axum layered on RedisStore, {what}"),
                c,
                route,
            ));
            report.rows.push(Row::from_load(
                "redis",
                format!("RedisStore scripts without HTTP, {what}"),
                c,
                direct,
            ));
        }
        report.ratios.push(
            Ratio::new(
                format!("RedisStore first executions req/s / its scripts' rate (c={c})"),
                first.rps() / direct_first.rps(),
                Target::None,
            )
            .note("a first execution is two scripts: claim, then complete"),
        );
        report.ratios.push(
            Ratio::new(
                format!("RedisStore replays req/s / its script's rate (c={c})"),
                replay.rps() / direct_replay.rps(),
                Target::None,
            )
            .note("a replay is one script: the claim finds the completed record"),
        );
    }
    drop(node);
    Ok(())
}

/// `bench-server redis-load` at concurrency `c`, as a load run.
fn direct(bench: &Bench, url: &str, c: usize, mode: &str) -> Result<Measured, String> {
    let mut command = Command::new(&bench.binaries.server);
    command
        .args(["redis-load", "--url", url, "--mode", mode])
        .args(["--concurrency", &c.to_string()])
        .args([
            "--warmup-ms",
            &bench.settings.warmup.as_millis().to_string(),
        ])
        .args([
            "--duration-ms",
            &bench.settings.duration.as_millis().to_string(),
        ]);
    let json = helper_json(command, Duration::from_secs(120))?;
    let number = |name: &str| {
        json[name]
            .as_f64()
            .ok_or_else(|| format!("redis-load answered no {name}: {json}"))
    };
    let operations = number("operations")? as u64;
    Ok(Measured {
        requests: operations,
        answered: operations,
        seconds: number("seconds")?,
        run_seconds: number("seconds")?,
        p50_ms: number("p50_ms")?,
        p99_ms: number("p99_ms")?,
        ..Measured::default()
    })
}
