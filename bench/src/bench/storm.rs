//! The retry storm, measured (`cargo xtask storm`, or the bench's section
//! `storm`): what a retry strategy does to a server that has just failed
//! every client at once.
//!
//! Per strategy, a fresh payments-axum (`--store memory`) whose charges call
//! a stand-in provider (`--provider-url`) that answers `503` for the outage
//! (each charge then answers `502`, released: retried with its key), then
//! `200`. The clients (100 in full and quick mode), each its own account and
//! key, are released at one instant and keep their charge going until it
//! succeeds: one idem-client exchange (up to 1,000 retries by the strategy's
//! policy), and should that end unsuccessful (only a budget's refusal does),
//! another with the same key after the strategy's backoff. Each attempt is
//! stamped as it leaves its client (a middleware inside the retries; on
//! loopback, its arrival at the server), and counted again where the server
//! serves it: every attempt reaches the charge's handler once (no two
//! attempts of one key overlap), and every handler calls the provider once,
//! so the provider's arrivals are the requests served, in the same clock.
//!
//! The strategies, side by side in one run: immediate retry; exponential
//! backoff without jitter (first retry after 1 s, doubling, capped at 30 s:
//! [`Backoff::for_clients`]'s bounds); the same with full jitter; full
//! jitter with idem-client's default retry budget (20 % of first attempts
//! over 10 s, plus 10 a second). The figures: the peak of retried requests in
//! any 10 ms (the first attempts, all at once in every strategy, are left
//! out: they are the outage's, not the strategy's), the time until every
//! charge succeeded, the clients' latency p50 and p99, the requests in all,
//! and charges applied twice (must be 0). Histograms of every request per
//! 10 ms: a chart in the terminal, and `target/bench/storm.svg`.
//!
//! [`Backoff::for_clients`]: idem_core::retry::Backoff::for_clients

use std::collections::HashSet;
use std::fmt::Write as _;
use std::process::Command;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use http::Extensions;
use idem_client::reqwest_middleware::{
    self, ClientBuilder, ClientWithMiddleware, Middleware, Next,
};
use idem_client::{IdempotentRetry, attempts};
use idem_core::retry::{Backoff, Jitter, RetryPolicy};
use idem_testkit::shell::target_dir;
use payments_provider::Provider;

use super::Bench;
use super::process::{Process, write_file};
use super::report::{Figure, Ratio, Report, Target};

/// The histograms' bin.
const BIN: Duration = Duration::from_millis(10);

/// The longest a strategy may take before the section gives up on it.
const LIMIT: Duration = Duration::from_secs(120);

/// Retries one exchange may make: many more than any outage here needs, so
/// that only a budget ends an exchange early.
const MANY: u32 = 1_000;

const BODY: &str = r#"{"amount":100,"currency":"EUR"}"#;

/// How the clients retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    Immediate,
    Exponential,
    FullJitter,
    Budgeted,
}

impl Strategy {
    const ALL: [Self; 4] = [
        Self::Immediate,
        Self::Exponential,
        Self::FullJitter,
        Self::Budgeted,
    ];

    /// Its name in the figures (`peak requests per 10 ms, NAME`).
    fn name(self) -> &'static str {
        match self {
            Self::Immediate => "immediate retry",
            Self::Exponential => "exponential without jitter",
            Self::FullJitter => "exponential with full jitter",
            Self::Budgeted => "full jitter and the budget",
        }
    }

    /// The backoff between attempts, for a first retry bound of `base`.
    fn backoff(self, base: Duration) -> Backoff {
        let cap = Duration::from_secs(30);
        match self {
            Self::Immediate => Backoff::new(Duration::ZERO, Duration::ZERO),
            Self::Exponential => Backoff::new(base, cap).jitter(Jitter::None),
            Self::FullJitter | Self::Budgeted => Backoff::new(base, cap),
        }
    }

    fn middleware(self, base: Duration) -> IdempotentRetry {
        let policy = RetryPolicy::default()
            .backoff(self.backoff(base))
            .max_retries(MANY);
        // The naive client does not wait the server's `Retry-After` either.
        let policy = match self {
            Self::Immediate => policy.retry_after_cap(Duration::ZERO),
            _ => policy,
        };
        let retry = IdempotentRetry::new().policy(policy);
        match self {
            Self::Budgeted => retry,
            _ => retry.without_budget(),
        }
    }
}

/// What one strategy's storm measured, in times since the clients' release.
struct Storm {
    strategy: Strategy,
    /// Every attempt as it reached the server: stamped as it left its
    /// client, over loopback.
    arrivals: Vec<Duration>,
    /// The same, the first attempt of each charge left out.
    retries: Vec<Duration>,
    /// Every request as the server served it: its provider call's arrival.
    served: Vec<Duration>,
    /// Each client's time until its charge succeeded, sorted.
    latencies: Vec<Duration>,
    /// Attempts as the clients counted them.
    sent: u64,
    /// Charges with more than one operation on their account.
    twice: usize,
}

impl Storm {
    fn peak(times: &[Duration]) -> usize {
        bins(times).into_iter().max().unwrap_or(0)
    }

    fn quantile(&self, q: f64) -> Duration {
        let last = self.latencies.len().saturating_sub(1);
        let at = ((last as f64) * q).round() as usize;
        self.latencies.get(at).copied().unwrap_or_default()
    }
}

/// How many of `times` fall in each 10 ms bin from 0.
fn bins(times: &[Duration]) -> Vec<usize> {
    let index = |time: &Duration| (time.as_micros() / BIN.as_micros()) as usize;
    let mut counts = vec![0; times.iter().map(index).max().map_or(0, |last| last + 1)];
    for time in times {
        counts[index(time)] += 1;
    }
    counts
}

pub(super) fn storm(bench: &Bench, report: &mut Report) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("a runtime: {e}"))?;
    let settings = &bench.settings;
    let mut storms = Vec::new();
    for strategy in Strategy::ALL {
        let provider = Arc::new(
            runtime
                .block_on(Provider::start())
                .map_err(|e| format!("the provider: {e}"))?,
        );
        let mut command = Command::new(&bench.binaries.payments);
        command.args(["--listen", "127.0.0.1:0", "--store", "memory"]);
        command.args(["--provider-url", &provider.url()]);
        let server = Process::start(
            command,
            "listening on http://",
            Duration::from_secs(30),
            &bench.logs.join("payments-axum-storm.log"),
        )?;
        let base = format!("http://{}", server.announced);
        let run = Run {
            strategy,
            base,
            clients: settings.storm_clients,
            outage: settings.storm_outage,
            first_retry: settings.storm_base,
        };
        let storm = runtime.block_on(async {
            tokio::time::timeout(LIMIT, run.storm(&provider))
                .await
                .map_err(|_| {
                    format!(
                        "{}: not every charge succeeded within {LIMIT:?}",
                        strategy.name()
                    )
                })?
        })?;
        // Killed: its accounts were read.
        drop(server);
        storms.push(storm);
    }
    let clients = settings.storm_clients;
    let outage = settings.storm_outage.as_secs_f64();
    for storm in &storms {
        let name = storm.strategy.name();
        let figure = |what: &str, value: f64, unit: &'static str, note: String| Figure {
            section: "storm",
            what: format!("{what}, {name}"),
            value: Some(value),
            unit,
            note,
        };
        report.figures.push(figure(
            "peak requests per 10 ms",
            Storm::peak(&storm.retries) as f64,
            "",
            format!(
                "retries reaching the server; with the {clients} first attempts, sent together in every strategy: {}",
                Storm::peak(&storm.arrivals)
            ),
        ));
        report.figures.push(figure(
            "peak requests served per 10 ms",
            Storm::peak(&storm.served) as f64,
            "",
            "charges whose provider call began: the server's pace, whatever came".to_owned(),
        ));
        report.figures.push(figure(
            "time until every charge succeeded",
            storm
                .latencies
                .last()
                .copied()
                .unwrap_or_default()
                .as_secs_f64()
                * 1e3,
            "ms",
            format!("{clients} clients; the provider failed for {outage:.1} s"),
        ));
        report.figures.push(figure(
            "client latency p50",
            storm.quantile(0.5).as_secs_f64() * 1e3,
            "ms",
            String::new(),
        ));
        report.figures.push(figure(
            "client latency p99",
            storm.quantile(0.99).as_secs_f64() * 1e3,
            "ms",
            String::new(),
        ));
        report.figures.push(figure(
            "requests in all",
            storm.served.len() as f64,
            "",
            format!(
                "at the server; the clients counted {} attempts",
                super::report::thousands(storm.sent)
            ),
        ));
        report.figures.push(figure(
            "charges applied twice",
            storm.twice as f64,
            "",
            "must be 0: every attempt carried its charge's one key".to_owned(),
        ));
    }
    let peak = |strategy: Strategy| {
        storms
            .iter()
            .find(|storm| storm.strategy == strategy)
            .map(|storm| Storm::peak(&storm.retries))
    };
    if let (Some(plain), Some(jittered)) = (peak(Strategy::Exponential), peak(Strategy::FullJitter))
    {
        report.ratios.push(Ratio::new(
            "storm: peak retries per 10 ms, exponential without jitter / with full jitter",
            plain as f64 / jittered.max(1) as f64,
            Target::AtLeast(10.0),
        ));
    }
    let twice: usize = storms.iter().map(|storm| storm.twice).sum();
    println!("\n{}", chart(&storms));
    let svg = target_dir().join("bench/storm.svg");
    write_file(&svg, &drawing(&storms, clients, settings.storm_outage))?;
    println!("drawn to {}", svg.display());
    if twice > 0 {
        return Err(format!("{twice} charge(s) applied twice"));
    }
    Ok(())
}

/// One strategy's storm against one server.
struct Run {
    strategy: Strategy,
    /// `http://HOST:PORT` of payments-axum.
    base: String,
    clients: usize,
    outage: Duration,
    first_retry: Duration,
}

impl Run {
    async fn storm(&self, provider: &Arc<Provider>) -> Result<Storm, String> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|e| e.to_string())?;
        let stamps = Stamps::default();
        let client = ClientBuilder::new(http)
            .with(self.strategy.middleware(self.first_retry))
            .with(stamps.clone())
            .build();
        let run = &uuid::Uuid::new_v4().simple().to_string()[..8];
        provider.answer_with(503);
        let (release, released) = tokio::sync::watch::channel(false);
        let backoff = self.strategy.backoff(self.first_retry);
        let tasks: Vec<_> = (0..self.clients)
            .map(|i| {
                let mut released = released.clone();
                let charge = Charge {
                    client: client.clone(),
                    url: format!("{}/accounts/storm-{run}-{i}/charges", self.base),
                    key: format!("storm-{run}-{i}"),
                    backoff,
                };
                tokio::spawn(async move {
                    released
                        .wait_for(|go| *go)
                        .await
                        .map_err(|_| "never released".to_owned())?;
                    charge.until_applied().await
                })
            })
            .collect();
        drop(released);
        let started = Instant::now();
        let _ = release.send(true);
        let recovery = {
            let (provider, outage) = (provider.clone(), self.outage);
            tokio::spawn(async move {
                tokio::time::sleep(outage).await;
                provider.answer_with(200);
            })
        };
        let mut latencies = Vec::with_capacity(self.clients);
        let mut sent = 0;
        for task in tasks {
            let (latency, attempts) = task.await.map_err(|e| e.to_string())??;
            latencies.push(latency);
            sent += u64::from(attempts);
        }
        let _ = recovery.await;
        latencies.sort();
        let mut seen = HashSet::new();
        let (mut arrivals, mut retries) = (Vec::new(), Vec::new());
        for (at, key) in stamps.taken() {
            let since = at.saturating_duration_since(started);
            arrivals.push(since);
            if !seen.insert(key) {
                retries.push(since);
            }
        }
        let served = provider
            .arrivals()
            .into_iter()
            .map(|(at, _key)| at.saturating_duration_since(started))
            .collect();
        let mut twice = 0;
        for i in 0..self.clients {
            let url = format!("{}/accounts/storm-{run}-{i}", self.base);
            let account: serde_json::Value = client
                .get(&url)
                .header("authorization", "Bearer storm")
                .send()
                .await
                .map_err(|e| format!("GET {url}: {e}"))?
                .json()
                .await
                .map_err(|e| format!("GET {url}: {e}"))?;
            match account["operations"].as_u64() {
                Some(1) => {}
                Some(0) | None => return Err(format!("GET {url}: no charge applied: {account}")),
                Some(_) => twice += 1,
            }
        }
        Ok(Storm {
            strategy: self.strategy,
            arrivals,
            retries,
            served,
            latencies,
            sent,
            twice,
        })
    }
}

/// When each attempt left its client, with its key: a middleware inside
/// the retries, so that it sees every attempt.
#[derive(Clone, Default)]
struct Stamps(Arc<Mutex<Vec<(Instant, String)>>>);

impl Stamps {
    fn taken(&self) -> Vec<(Instant, String)> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[async_trait::async_trait]
impl Middleware for Stamps {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let key = request
            .headers()
            .get("idempotency-key")
            .and_then(|key| key.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((Instant::now(), key));
        next.run(request, extensions).await
    }
}

/// One client's charge.
struct Charge {
    client: ClientWithMiddleware,
    url: String,
    key: String,
    /// Between exchanges that ended unsuccessful.
    backoff: Backoff,
}

impl Charge {
    /// Sends the charge until it succeeds: its latency and attempts.
    async fn until_applied(self) -> Result<(Duration, u32), String> {
        let started = Instant::now();
        let mut sent = 0;
        for exchange in 1.. {
            let answer = self
                .client
                .post(&self.url)
                .header("authorization", "Bearer storm")
                .header("idempotency-key", &self.key)
                .header("content-type", "application/json")
                .body(BODY)
                .send()
                .await;
            match answer {
                Ok(answer) => {
                    sent += attempts(&answer).map_or(1, |a| a.sent);
                    if answer.status().is_success() {
                        return Ok((started.elapsed(), sent));
                    }
                }
                Err(_) => sent += 1,
            }
            tokio::time::sleep(self.backoff.delay(exchange)).await;
        }
        Err("the exchanges ran out".to_owned())
    }
}

/// Block characters, lowest to highest.
const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// The requests per 10 ms of each strategy as a line of blocks, each column
/// the busiest 10 ms of its span, each line on its own scale.
fn chart(storms: &[Storm]) -> String {
    let width = 96;
    let longest = storms
        .iter()
        .map(|storm| bins(&storm.arrivals).len())
        .max()
        .unwrap_or(0);
    let per_column = longest.div_ceil(width).max(1);
    let mut out = format!(
        "requests per 10 ms at the server, first attempts included (a column: the busiest 10 ms of {} ms; a line: its own scale)\n",
        per_column * 10
    );
    for storm in storms {
        let counts = bins(&storm.arrivals);
        let peak = counts.iter().copied().max().unwrap_or(0).max(1);
        let line: String = counts
            .chunks(per_column)
            .map(|chunk| match chunk.iter().copied().max().unwrap_or(0) {
                0 => ' ',
                n => LEVELS[((n * LEVELS.len()).div_ceil(peak)).clamp(1, LEVELS.len()) - 1],
            })
            .collect();
        let _ = writeln!(
            out,
            "{:<28} peak {:>4} |{line}",
            storm.strategy.name(),
            peak
        );
    }
    let _ = write!(
        out,
        "{:<28}           0 s{:>width$}",
        "",
        format!("{:.1} s", (longest * 10) as f64 / 1e3),
        width = (longest.div_ceil(per_column)).saturating_sub(3)
    );
    out
}

/// The same histograms as an SVG: a panel per strategy on one time axis,
/// each bar one 10 ms bin, each panel on its own scale (its peak written).
fn drawing(storms: &[Storm], clients: usize, outage: Duration) -> String {
    let (left, width, panel, gap) = (210.0, 740.0, 110.0, 30.0);
    let longest = storms
        .iter()
        .map(|storm| bins(&storm.arrivals).len())
        .max()
        .unwrap_or(1)
        .max(1);
    let bar = width / longest as f64;
    let height = 50.0 + storms.len() as f64 * (panel + gap);
    let mut svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="10" y="20" font-size="14">{clients} clients fail at once (the provider down {outage:.1} s): requests per 10 ms at payments-axum (red: the provider down; each panel its own scale)</text>
"##,
        w = left + width + 20.0,
        outage = outage.as_secs_f64(),
    );
    let outage_x = left + outage.as_secs_f64() * 100.0 * bar;
    for (n, storm) in storms.iter().enumerate() {
        let top = 40.0 + n as f64 * (panel + gap);
        let counts = bins(&storm.arrivals);
        let peak = counts.iter().copied().max().unwrap_or(0).max(1);
        let _ = writeln!(
            svg,
            r##"<text x="10" y="{y}" font-weight="bold">{name}</text><text x="10" y="{y2}" fill="#555" font-size="11">peak {peak} per 10 ms</text><text x="10" y="{y3}" fill="#555" font-size="11">retries' peak {retries}</text><text x="10" y="{y4}" fill="#555" font-size="11">{total} requests</text>"##,
            y = top + panel / 2.0 - 16.0,
            y2 = top + panel / 2.0 + 2.0,
            y3 = top + panel / 2.0 + 17.0,
            y4 = top + panel / 2.0 + 32.0,
            name = storm.strategy.name(),
            retries = Storm::peak(&storm.retries),
            total = super::report::thousands(storm.arrivals.len() as u64),
        );
        let _ = writeln!(
            svg,
            r##"<rect x="{left}" y="{top}" width="{outage_w}" height="{panel}" fill="#fde8e8"/><line x1="{left}" y1="{base}" x2="{right}" y2="{base}" stroke="#999"/>"##,
            outage_w = outage_x - left,
            base = top + panel,
            right = left + width,
        );
        for (i, count) in counts.iter().enumerate().filter(|(_, c)| **c > 0) {
            let h = panel * *count as f64 / peak as f64;
            let _ = writeln!(
                svg,
                r##"<rect x="{x:.2}" y="{y:.2}" width="{bar:.2}" height="{h:.2}" fill="#3366cc"/>"##,
                x = left + i as f64 * bar,
                y = top + panel - h,
            );
        }
    }
    let axis = 40.0 + storms.len() as f64 * (panel + gap) - gap + 14.0;
    let seconds = (longest as f64 / 100.0).ceil() as usize;
    for second in 0..=seconds {
        let x = left + second as f64 * 100.0 * bar;
        if x <= left + width + 1.0 {
            let _ = writeln!(
                svg,
                r##"<text x="{x:.1}" y="{axis}" text-anchor="middle">{second} s</text>"##
            );
        }
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_fall_in_their_10_ms_bins() {
        let ms = Duration::from_millis;
        assert_eq!(bins(&[ms(0), ms(9), ms(10), ms(35)]), vec![2, 1, 0, 1]);
        assert_eq!(Storm::peak(&[ms(0), ms(9), ms(10), ms(35)]), 2);
        assert!(bins(&[]).is_empty());
    }
}
