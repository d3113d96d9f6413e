//! Load runs: `bench-server load` (a release build, its own process, pinned
//! to CPU 0 when the server is pinned to CPU 1) and what it measured.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use super::process::{Background, helper_json};

/// One load run.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub(crate) addr: SocketAddr,
    /// The request path; `{w}` is replaced by the client's number.
    pub(crate) path: String,
    /// Extra header lines, `Name: value`.
    pub(crate) headers: Vec<String>,
    pub(crate) body: String,
    pub(crate) keys: Keys,
    pub(crate) concurrency: usize,
    pub(crate) warmup: Duration,
    pub(crate) duration: Duration,
    pub(crate) expect: Expect,
    /// The CPU the generator is pinned to.
    pub(crate) cpu: Option<usize>,
}

/// Which `Idempotency-Key` each request carries.
#[derive(Clone, Debug)]
pub(crate) enum Keys {
    /// A new key for every request, under this prefix.
    Fresh(String),
    /// Keys `{prefix}0` to `{prefix}{pool - 1}`, each completed before the run.
    Replay { prefix: String, pool: usize },
}

/// What a right answer is.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Expect {
    /// `201`, executed by the handler.
    Executed,
    /// `201`, replayed.
    Replayed,
    /// Any `2xx`.
    Success,
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub(crate) struct Measured {
    pub(crate) requests: u64,
    pub(crate) seconds: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    /// Every answer, warm-up and priming included.
    pub(crate) answered: u64,
    /// The generator's CPU use over its run, in % of one core.
    pub(crate) generator_cpu: Option<f64>,
    /// The server's CPU time over the generator's run (set by the caller).
    pub(crate) server_cpu_seconds: Option<f64>,
    /// The generator's run, start to end, in seconds (set by the caller).
    pub(crate) run_seconds: f64,
    /// PostgreSQL's CPU time over the run, when it serves the store (set by
    /// the caller).
    pub(crate) database_cpu_seconds: Option<f64>,
}

impl Measured {
    /// PostgreSQL's CPU time per answer, in microseconds.
    pub(crate) fn database_micros_per_request(&self) -> Option<f64> {
        let seconds = self.database_cpu_seconds?;
        (self.answered > 0).then(|| seconds * 1e6 / self.answered as f64)
    }

    /// The server's CPU use over the run, in % of one core.
    pub(crate) fn server_cpu_percent(&self) -> Option<f64> {
        let seconds = self.server_cpu_seconds?;
        (self.run_seconds > 0.0).then(|| seconds / self.run_seconds * 100.0)
    }

    /// The server's CPU time per answer, in microseconds: what a request costs
    /// it, whatever else competes for the CPU.
    pub(crate) fn server_micros_per_request(&self) -> Option<f64> {
        let seconds = self.server_cpu_seconds?;
        (self.answered > 0).then(|| seconds * 1e6 / self.answered as f64)
    }

    /// Right answers per second.
    pub(crate) fn rps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.requests as f64 / self.seconds
        } else {
            0.0
        }
    }

    /// Two runs of one workload as one: requests and time add up; the
    /// quantiles are the mean of the two runs'.
    pub(crate) fn pooled(self, other: Self) -> Self {
        if self.run_seconds == 0.0 && self.requests == 0 {
            return other;
        }
        Self {
            requests: self.requests + other.requests,
            seconds: self.seconds + other.seconds,
            p50_ms: (self.p50_ms + other.p50_ms) / 2.0,
            p99_ms: (self.p99_ms + other.p99_ms) / 2.0,
            errors: self.errors + other.errors,
            first_error: self.first_error.or(other.first_error),
            answered: self.answered + other.answered,
            generator_cpu: match (self.generator_cpu, other.generator_cpu) {
                (Some(a), Some(b)) => Some((a + b) / 2.0),
                (a, b) => a.or(b),
            },
            server_cpu_seconds: match (self.server_cpu_seconds, other.server_cpu_seconds) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            },
            run_seconds: self.run_seconds + other.run_seconds,
            database_cpu_seconds: match (self.database_cpu_seconds, other.database_cpu_seconds) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            },
        }
    }

    fn from_json(answer: &Value) -> Self {
        Self {
            requests: answer["requests"].as_u64().unwrap_or_default(),
            seconds: answer["seconds"].as_f64().unwrap_or_default(),
            p50_ms: answer["p50_ms"].as_f64().unwrap_or_default(),
            p99_ms: answer["p99_ms"].as_f64().unwrap_or_default(),
            errors: answer["errors"].as_u64().unwrap_or_default(),
            first_error: answer["first_error"].as_str().map(str::to_owned),
            answered: answer["answered"].as_u64().unwrap_or_default(),
            generator_cpu: match (
                answer["cpu_seconds"].as_f64(),
                answer["wall_seconds"].as_f64(),
            ) {
                (Some(cpu), Some(wall)) if wall > 0.0 => Some(cpu / wall * 100.0),
                _ => None,
            },
            server_cpu_seconds: None,
            run_seconds: 0.0,
            database_cpu_seconds: None,
        }
    }
}

impl Plan {
    fn command(&self, server: &Path, stop_on_eof: bool) -> Command {
        let mut command = match self.cpu {
            Some(cpu) => {
                let mut command = Command::new("taskset");
                command.args(["-c", &cpu.to_string()]).arg(server);
                command
            }
            None => Command::new(server),
        };
        command
            .arg("load")
            .args(["--addr", &self.addr.to_string()])
            .args(["--path", &self.path])
            .args(["--body", &self.body])
            .args(["--concurrency", &self.concurrency.to_string()])
            .args(["--warmup-ms", &self.warmup.as_millis().to_string()])
            .args(["--duration-ms", &self.duration.as_millis().to_string()])
            .args([
                "--expect",
                match self.expect {
                    Expect::Executed => "executed",
                    Expect::Replayed => "replayed",
                    Expect::Success => "success",
                },
            ]);
        for header in &self.headers {
            command.args(["--header", header]);
        }
        match &self.keys {
            Keys::Fresh(prefix) => command.args(["--fresh-keys", prefix]),
            Keys::Replay { prefix, pool } => command
                .args(["--replay-keys", prefix.as_str()])
                .args(["--pool", &pool.to_string()]),
        };
        if stop_on_eof {
            command.arg("--stop-on-eof");
        }
        command
    }
}

/// Runs `plan` to its end.
pub(crate) fn run(server: &Path, plan: &Plan) -> Result<Measured, String> {
    let bound = plan.warmup + plan.duration + Duration::from_secs(120);
    helper_json(plan.command(server, false), bound).map(|answer| Measured::from_json(&answer))
}

/// A run that measures until [`Running::stop`].
pub(crate) struct Running {
    background: Background,
}

/// Starts `plan`; its window ends when stopped (or after its duration).
pub(crate) fn start(server: &Path, plan: &Plan) -> Result<Running, String> {
    Background::start(plan.command(server, true), true).map(|background| Running { background })
}

impl Running {
    /// Ends the measured window and answers what it measured.
    pub(crate) fn stop(mut self) -> Result<Measured, String> {
        self.background.close_stdin();
        self.background
            .answer(Duration::from_secs(60))
            .map(|answer| Measured::from_json(&answer))
    }
}
