//! The peers: published idempotency middleware in front of the same handler,
//! under the same load, in the same run as idem's layered route (axum).
//!
//! Each peer is a small server of its own under `bench/peers/<name>/`, a cargo
//! project outside the workspace (its own `[workspace]` and `Cargo.lock`),
//! built here into `target/bench/peers`; `bench/peers/README.md` says what each
//! one is and how it is configured. A peer serves `POST /layered` (the bench's
//! handler behind its middleware), `POST /layered-slow` (the same after 100 ms)
//! and `GET /executions`, as `bench-server serve` does.
//!
//! - In memory (server pinned with one worker, as in the overhead rows): the
//!   bare handler, idem's in-memory store and axum-idempotent on ruts'
//!   `MokaStore`, first executions and replays, interleaved in rounds.
//! - On PostgreSQL (nothing pinned, as in the PostgreSQL rows, one throwaway
//!   cluster, a database each): idem's `PgStore`, axum-idempotent on ruts'
//!   `PostgresStore` and cratestack-axum, with PostgreSQL's CPU time per
//!   request.
//! - Duplicates: 50 parallel requests with one new key and one body to each
//!   server's slow route, then the number of times its handler ran.
//!
//! Building the peers from a cold cache takes minutes, so they run in the full
//! mode only.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use super::load::{Expect, Measured};
use super::overhead::{GENERATOR_CPU, SERVER_CPU};
use super::postgres::{cluster, url, with_database_cpu};
use super::process::Process;
use super::report::{Figure, Ratio, Report, Row, Target, thousands};
use super::{Bench, Framework, KeySource, Server, Workload, request_body};
use idem_testkit::shell::{self, cargo, target_dir, workspace_root};

/// Client counts of the in-memory rows.
const MEMORY_CONCURRENCIES: [usize; 2] = [16, 64];
/// Client counts of the PostgreSQL rows.
const POSTGRES_CONCURRENCIES: [usize; 2] = [1, 16];
/// Parallel duplicates of the duplicates check.
const DUPLICATES: usize = 50;

/// What idem's replays should do against the fastest peer's.
const REPLAY_TARGET: f64 = 1.2;

/// A published peer, as `bench/peers/<name>/` serves it.
struct Peer {
    /// Its directory under `bench/peers`.
    name: &'static str,
    /// Its binary (the package's name).
    binary: &'static str,
    /// In memory: what runs, versions included (the rows' label).
    memory: Option<&'static str>,
    /// On PostgreSQL: what runs, versions included (the rows' label).
    postgres: Option<&'static str>,
    /// Header lines every request carries; `{session}` as `bench-server load`
    /// reads it.
    headers: &'static [&'static str],
}

const PEERS: [Peer; 2] = [
    Peer {
        name: "axum-idempotent",
        binary: "peer-axum-idempotent",
        memory: Some("axum-idempotent 0.6.0 (ruts 0.13 MokaStore)"),
        postgres: Some("axum-idempotent 0.6.0 (ruts 0.13 PostgresStore)"),
        // It keeps records in the caller's session and never starts one: each
        // key comes with a session of its own, as if from a user of its own.
        headers: &["Cookie: session={session}"],
    },
    Peer {
        name: "cratestack-axum",
        binary: "peer-cratestack-axum",
        memory: None,
        postgres: Some("cratestack-axum 0.8.15 (cratestack-sqlx)"),
        headers: &[],
    },
];

/// idem's rows, beside the peers'.
const IDEM_MEMORY: &str = "idem (idem-axum, MemoryStore)";
const IDEM_POSTGRES: &str = "idem (idem-axum, PgStore)";

/// A peer built and ready to start on one kind of store.
struct Built<'a> {
    peer: &'a Peer,
    binary: PathBuf,
    /// What runs on that store.
    label: &'static str,
}

/// Builds the peers, then runs the in-memory and PostgreSQL comparisons.
pub(super) fn peers(bench: &Bench, report: &mut Report) -> Result<(), String> {
    if bench.settings.mode != "full" {
        report.notes.push(
            "peers: full run only (building them takes minutes): cargo xtask bench --only peers"
                .to_owned(),
        );
        return Ok(());
    }
    let mut memory_peers = Vec::new();
    let mut postgres_peers = Vec::new();
    for peer in &PEERS {
        match build(peer) {
            Ok(binary) => {
                let built = |label| Built {
                    peer,
                    binary: binary.clone(),
                    label,
                };
                memory_peers.extend(peer.memory.map(built));
                postgres_peers.extend(peer.postgres.map(built));
            }
            Err(error) => report
                .failures
                .push(format!("peers: {}: {error}", peer.name)),
        }
    }
    report.notes.push(
        "peer rows: the same handler and load as idem's, interleaved with idem's rows; \
         bench/peers/README.md says how each peer is configured"
            .to_owned(),
    );
    let in_memory = memory(bench, report, &memory_peers);
    let on_postgres = postgres(bench, report, &postgres_peers);
    in_memory.and(on_postgres)
}

/// `cargo build --release --locked` of one peer, into `target/bench/peers`.
fn build(peer: &Peer) -> Result<PathBuf, String> {
    let root = workspace_root();
    let manifest = root.join("bench/peers").join(peer.name).join("Cargo.toml");
    let target = target_dir().join("bench/peers");
    let manifest = manifest.to_string_lossy();
    let target_dir = target.to_string_lossy();
    let args = [
        "build",
        "-q",
        "--release",
        "--locked",
        "--manifest-path",
        &manifest,
        "--target-dir",
        &target_dir,
    ];
    shell::run(
        &format!("cargo build --release (peer {})", peer.name),
        &mut cargo(&args),
    )?;
    Ok(target.join("release").join(peer.binary))
}

/// Starts a peer on `store`, pinned to `cpu` with one worker thread, or with
/// two unpinned (as [`Bench::serve`] starts `bench-server`).
fn start(
    bench: &Bench,
    built: &Built<'_>,
    store: &str,
    pool: usize,
    cpu: Option<usize>,
) -> Result<Server, String> {
    let cpu = cpu.filter(|_| bench.pin);
    let mut command = bench.pinned(&built.binary, cpu);
    command
        .args(["--store", store])
        .args(["--workers", if cpu.is_some() { "1" } else { "2" }])
        .args(["--pool", &pool.to_string()]);
    let process = Process::start(
        command,
        "listening on http://",
        Duration::from_secs(120),
        &bench.logs.join(format!("peer-{}.log", built.peer.name)),
    )?;
    let addr = process
        .announced
        .parse()
        .map_err(|e| format!("{} announced {:?}: {e}", built.peer.name, process.announced))?;
    Ok(Server {
        process,
        addr,
        headers: built.peer.headers.iter().map(|h| (*h).to_owned()).collect(),
    })
}

/// A server's first executions and replays, under one label.
struct Side<'a> {
    label: &'a str,
    server: &'a Server,
}

impl Side<'_> {
    fn workloads(&self) -> [Workload<'_>; 2] {
        [
            Workload {
                server: self.server,
                path: "/layered",
                keys: KeySource::Fresh,
                expect: Expect::Executed,
            },
            Workload {
                server: self.server,
                path: "/layered",
                keys: KeySource::Replay(format!("r{}-", uuid::Uuid::new_v4().simple())),
                expect: Expect::Replayed,
            },
        ]
    }
}

/// What one side measured at one concurrency.
struct Measures {
    label: String,
    first: Measured,
    replay: Measured,
}

/// idem's in-memory store against the in-memory peers.
fn memory(bench: &Bench, report: &mut Report, peers: &[Built<'_>]) -> Result<(), String> {
    if peers.is_empty() {
        return Ok(());
    }
    for c in MEMORY_CONCURRENCIES {
        let idem = bench.serve(Framework::Axum, &["--store", "memory"], Some(SERVER_CPU))?;
        let servers = peers
            .iter()
            .map(|built| start(bench, built, "memory", 0, Some(SERVER_CPU)))
            .collect::<Result<Vec<_>, _>>()?;
        let sides = sides(IDEM_MEMORY, &idem, peers, &servers);
        let compared = compare(Some(&idem), &sides, |workloads| {
            bench.interleaved(workloads, c, Some(GENERATOR_CPU))
        })?;
        add(report, "in memory", c, &compared);
    }
    // The duplicates check, on fresh servers.
    let idem = bench.serve(Framework::Axum, &["--store", "memory"], Some(SERVER_CPU))?;
    duplicates_figure(report, IDEM_MEMORY, &idem);
    drop(idem);
    for built in peers {
        let server = start(bench, built, "memory", 0, Some(SERVER_CPU))?;
        duplicates_figure(report, built.label, &server);
    }
    Ok(())
}

/// idem's `PgStore` against the PostgreSQL peers, on one throwaway cluster.
fn postgres(bench: &Bench, report: &mut Report, peers: &[Built<'_>]) -> Result<(), String> {
    if peers.is_empty() {
        return Ok(());
    }
    let databases: Vec<String> = (0..=peers.len()).map(|i| format!("peers{i}")).collect();
    let (cluster, port) = cluster(bench, &databases.join(","))?;
    let outcome = postgres_rows(bench, report, peers, port, &databases);
    cluster.finish(Duration::from_secs(30));
    outcome
}

fn postgres_rows(
    bench: &Bench,
    report: &mut Report,
    peers: &[Built<'_>],
    port: u16,
    databases: &[String],
) -> Result<(), String> {
    let idem_url = url(port, &databases[0]);
    let peer_urls: Vec<String> = databases[1..].iter().map(|db| url(port, db)).collect();
    for c in POSTGRES_CONCURRENCIES {
        let pool = c.to_string();
        let idem = bench.serve(
            Framework::Axum,
            &["--store", &idem_url, "--pool", &pool],
            None,
        )?;
        let servers = peers
            .iter()
            .zip(&peer_urls)
            .map(|(built, url)| start(bench, built, url, c, None))
            .collect::<Result<Vec<_>, _>>()?;
        let sides = sides(IDEM_POSTGRES, &idem, peers, &servers);
        let compared = compare(None, &sides, |workloads| {
            let mut pooled = vec![Measured::default(); workloads.len()];
            for _ in 0..bench.settings.rounds {
                for (workload, total) in workloads.iter().zip(pooled.iter_mut()) {
                    let measured = with_database_cpu(bench, workload, c, port)?;
                    *total = std::mem::take(total).pooled(measured);
                }
            }
            Ok(pooled)
        })?;
        add(report, "on PostgreSQL", c, &compared);
        let measures = &compared.sides;
        let idem_cost = measures[0].first.database_micros_per_request();
        let lowest = measures[1..]
            .iter()
            .filter_map(|m| Some((m.first.database_micros_per_request()?, m)))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        match (idem_cost, lowest) {
            (Some(idem_cost), Some((lowest_cost, peer))) => {
                report.ratios.push(
                    Ratio::new(
                        format!("idem PostgreSQL CPU per first execution / lowest peer's (c={c})"),
                        idem_cost / lowest_cost,
                        Target::AtMost(1.0),
                    )
                    .note(format!(
                        "idem {idem_cost:.1} us, {} {lowest_cost:.1} us",
                        peer.label
                    )),
                );
            }
            _ => report.ratios.push(Ratio::missing(
                format!("idem PostgreSQL CPU per first execution / lowest peer's (c={c})"),
                Target::AtMost(1.0),
                "PostgreSQL's CPU time could not be read from /proc",
            )),
        }
        let replay_costs = measures
            .iter()
            .map(|m| m.replay.database_micros_per_request());
        if let Some(costs) = replay_costs.collect::<Option<Vec<f64>>>() {
            let lowest = costs[1..].iter().copied().fold(f64::INFINITY, f64::min);
            let named: Vec<String> = measures
                .iter()
                .zip(&costs)
                .map(|(m, cost)| format!("{} {cost:.1} us", m.label))
                .collect();
            report.ratios.push(
                Ratio::new(
                    format!("idem PostgreSQL CPU per replay / lowest peer's (c={c})"),
                    costs[0] / lowest,
                    Target::None,
                )
                .note(named.join(", ")),
            );
        }
    }
    let idem = bench.serve(
        Framework::Axum,
        &["--store", &idem_url, "--pool", "16"],
        None,
    )?;
    duplicates_figure(report, IDEM_POSTGRES, &idem);
    drop(idem);
    for (built, url) in peers.iter().zip(&peer_urls) {
        let server = start(bench, built, url, 16, None)?;
        duplicates_figure(report, built.label, &server);
    }
    Ok(())
}

/// idem's side first, then each peer's.
fn sides<'a>(
    idem_label: &'a str,
    idem: &'a Server,
    peers: &'a [Built<'a>],
    servers: &'a [Server],
) -> Vec<Side<'a>> {
    let mut sides = vec![Side {
        label: idem_label,
        server: idem,
    }];
    sides.extend(peers.iter().zip(servers).map(|(built, server)| Side {
        label: built.label,
        server,
    }));
    sides
}

/// What a comparison measured: the bare handler (in memory), then each side.
struct Compared {
    bare: Option<Measured>,
    sides: Vec<Measures>,
}

/// Runs the bare handler on `bare` (if any), then every side's first
/// executions and replays, through `run` (which interleaves them).
fn compare(
    bare: Option<&Server>,
    sides: &[Side<'_>],
    run: impl FnOnce(&[Workload<'_>]) -> Result<Vec<Measured>, String>,
) -> Result<Compared, String> {
    let bare_workload = bare.map(|server| Workload {
        server,
        path: "/bare",
        keys: KeySource::Fresh,
        expect: Expect::Executed,
    });
    let workloads: Vec<Workload<'_>> = bare_workload
        .into_iter()
        .chain(sides.iter().flat_map(Side::workloads))
        .collect();
    let mut measured = run(&workloads)?.into_iter();
    let bare = match bare {
        Some(_) => Some(measured.next().ok_or("a workload without a result")?),
        None => None,
    };
    let sides = sides
        .iter()
        .map(|side| {
            let first = measured.next().ok_or("a workload without a result")?;
            let replay = measured.next().ok_or("a workload without a result")?;
            Ok::<_, String>(Measures {
                label: side.label.to_owned(),
                first,
                replay,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(Compared { bare, sides })
}

/// The rows of one comparison (the bare handler, idem, the peers), and
/// idem's ratios to the fastest peer.
fn add(report: &mut Report, store: &str, c: usize, compared: &Compared) {
    if let Some(bare) = &compared.bare {
        report.rows.push(Row::from_load(
            "peers",
            "bare handler (bench-server, axum)",
            c,
            bare,
        ));
    }
    for side in &compared.sides {
        for (what, measured) in [("first execution", &side.first), ("replay", &side.replay)] {
            report.rows.push(Row::from_load(
                "peers",
                format!("{}, {what}", side.label),
                c,
                measured,
            ));
        }
    }
    let Some((idem, peers)) = compared.sides.split_first() else {
        return;
    };
    let bare_cost = compared
        .bare
        .as_ref()
        .and_then(Measured::server_micros_per_request);
    for (what, pick, target) in [
        (
            "first executions",
            (|m: &Measures| &m.first) as fn(&Measures) -> &Measured,
            Target::None,
        ),
        (
            "replays",
            |m: &Measures| &m.replay,
            Target::AtLeast(REPLAY_TARGET),
        ),
    ] {
        let Some(fastest) = peers
            .iter()
            .max_by(|a, b| pick(a).rps().total_cmp(&pick(b).rps()))
        else {
            continue;
        };
        let cost = |m: &Measures| match (pick(m).server_micros_per_request(), bare_cost) {
            (Some(us), Some(bare)) => format!("{us:.1} us (+{:.1} over bare)", us - bare),
            (Some(us), None) => format!("{us:.1} us"),
            (None, _) => "?".to_owned(),
        };
        report.ratios.push(
            Ratio::new(
                format!("idem {what} / fastest peer's, {store}, req/s (c={c})"),
                pick(idem).rps() / pick(fastest).rps(),
                target,
            )
            .note(format!(
                "{}: {} req/s; server CPU per request: idem {}, peer {}",
                fastest.label,
                thousands(pick(fastest).rps() as u64),
                cost(idem),
                cost(fastest)
            )),
        );
    }
}

/// The duplicates check on `server`, as a figure.
fn duplicates_figure(report: &mut Report, label: &str, server: &Server) {
    let what = format!("handler runs, {DUPLICATES} parallel duplicates of one new key: {label}");
    let figure = match duplicates(server) {
        Ok((executions, answers)) => Figure {
            section: "peers",
            what,
            value: Some(executions as f64),
            unit: "execution(s)",
            note: format!(
                "{}; answers: {answers}",
                if executions == 1 {
                    "kept one execution".to_owned()
                } else {
                    format!("{executions} executions")
                }
            ),
        },
        Err(error) => Figure {
            section: "peers",
            what,
            value: None,
            unit: "execution(s)",
            note: error,
        },
    };
    report.figures.push(figure);
}

/// Sends [`DUPLICATES`] requests with one new key and one body at once to
/// `server`'s slow route (its handler waits 100 ms, so they overlap); answers
/// how many times its handler ran meanwhile, and what the answers were.
fn duplicates(server: &Server) -> Result<(u64, String), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let client = reqwest::Client::new();
        let base = format!("http://{}", server.addr);
        let executions = || async {
            let text = client
                .get(format!("{base}/executions"))
                .send()
                .await
                .and_then(reqwest::Response::error_for_status)
                .map_err(|e| format!("GET /executions: {e}"))?
                .text()
                .await
                .map_err(|e| format!("GET /executions: {e}"))?;
            text.trim()
                .parse::<u64>()
                .map_err(|e| format!("GET /executions answered {text:?}: {e}"))
        };
        let key = format!("dup-{}", uuid::Uuid::new_v4().simple());
        // A ruts-shaped session id (see `bench-server load`), one for all.
        let session = format!("{}A", &uuid::Uuid::new_v4().simple().to_string()[..21]);
        let body = request_body();
        let before = executions().await?;
        let requests = (0..DUPLICATES).map(|_| {
            let mut request = client
                .post(format!("{base}/layered-slow"))
                .header("Idempotency-Key", &key)
                .header("Content-Type", "application/json")
                .body(body.clone());
            for line in &server.headers {
                if let Some((name, value)) = line.split_once(':') {
                    request =
                        request.header(name.trim(), value.trim().replace("{session}", &session));
                }
            }
            request.send()
        });
        let mut answers = BTreeMap::<(u16, bool), usize>::new();
        for answer in futures_util::future::join_all(requests).await {
            let answer = answer.map_err(|e| format!("a duplicate failed: {e}"))?;
            let replayed = ["idempotent-replayed", "idempotency-replayed"]
                .iter()
                .any(|name| answer.headers().get(*name).is_some_and(|v| v == "true"));
            *answers
                .entry((answer.status().as_u16(), replayed))
                .or_default() += 1;
        }
        let after = executions().await?;
        let answers: Vec<String> = answers
            .iter()
            .map(|((status, replayed), n)| {
                format!("{n} x {status}{}", if *replayed { " replayed" } else { "" })
            })
            .collect();
        Ok((after.saturating_sub(before), answers.join(", ")))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn every_peer_is_a_locked_project_of_its_own() {
        for peer in &PEERS {
            let dir = workspace_root().join("bench/peers").join(peer.name);
            let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
            assert!(
                manifest.contains(&format!("name = \"{}\"", peer.binary)),
                "{}: the package must be named {}",
                peer.name,
                peer.binary
            );
            assert!(
                manifest.lines().any(|line| line.trim() == "[workspace]"),
                "{}: a [workspace] table of its own keeps it out of idem's",
                peer.name
            );
            let lock = std::fs::read_to_string(dir.join("Cargo.lock")).unwrap();
            assert!(
                lock.contains(&format!("name = \"{}\"", peer.name)),
                "{}: Cargo.lock pins the peer's crate",
                peer.name
            );
        }
        let members = std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
        assert!(
            !members.contains("bench/peers"),
            "no peer is a workspace member"
        );
    }
}
