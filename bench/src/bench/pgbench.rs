//! pgbench running the store's own statements: PostgreSQL's limit for them.
//!
//! The statements come from the server itself (`bench-server pg-statements`
//! reads `pg_prepared_statements` after a claim, a completion and a replay
//! through `PgStore`), so pgbench runs exactly the text the store prepares. Its
//! `$n` parameters become pgbench variables cast to the types diesel bound, and
//! pgbench prepares them too (`-M prepared`): one round trip per statement, as
//! the store does.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

/// The two workloads, as pgbench scripts.
pub(crate) struct Scripts {
    /// A claim of a new key, then its completion (a first execution).
    pub(crate) first: String,
    /// A claim of a completed key (what a replay costs the database).
    pub(crate) replay: String,
    /// `-D name=value` definitions the scripts use.
    pub(crate) defines: Vec<(String, String)>,
}

/// What one pgbench run measured.
pub(crate) struct Outcome {
    pub(crate) tps: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) failed: u64,
    /// Transactions run (from the per-transaction log).
    pub(crate) transactions: u64,
    /// PostgreSQL's CPU time over the run.
    pub(crate) database_cpu_seconds: Option<f64>,
}

impl Outcome {
    /// Two runs of one script as one: the mean of each figure (the runs are
    /// equally long), failures added up.
    pub(crate) fn pooled(self, other: Self) -> Self {
        Self {
            tps: (self.tps + other.tps) / 2.0,
            p50_ms: (self.p50_ms + other.p50_ms) / 2.0,
            p99_ms: (self.p99_ms + other.p99_ms) / 2.0,
            failed: self.failed + other.failed,
            transactions: self.transactions + other.transactions,
            database_cpu_seconds: match (self.database_cpu_seconds, other.database_cpu_seconds) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            },
        }
    }
}

/// The parameter names of the claim statement, in order.
const CLAIM_PARAMS: [&str; 6] = ["scope", "k", "fingerprint", "owner", "lease", "retention"];
/// The parameter names of the complete statement, in order.
const COMPLETE_PARAMS: [&str; 8] = [
    "scope",
    "k",
    "owner",
    "status",
    "headers",
    "body",
    "replayable",
    "retention",
];

impl Scripts {
    /// Scripts from `bench-server pg-statements`'s answer; replays draw keys
    /// `0` to `pool - 1` (the keys the HTTP replay runs completed).
    pub(crate) fn new(statements: &Value, pool: usize) -> Result<Self, String> {
        let claim = statement(&statements["claim"], &CLAIM_PARAMS)?;
        let complete = statement(&statements["complete"], &COMPLETE_PARAMS)?;
        let values = statements["values"]
            .as_object()
            .ok_or("pg-statements gave no values")?;
        let defines = values
            .iter()
            .map(|(name, value)| (name.clone(), value.as_str().unwrap_or_default().to_owned()))
            .collect();
        // Keys far from the HTTP runs' (which are `{run}-{client}-{n}` or small
        // integers); a collision would only turn one claim into a replay.
        let first = format!("\\set k random(1000000000, 999999999999999)\n{claim};\n{complete};\n");
        let replay = format!("\\set k random(0, {})\n{claim};\n", pool.saturating_sub(1));
        Ok(Self {
            first,
            replay,
            defines,
        })
    }
}

/// The statement with `$n` replaced by `:name::type`.
fn statement(found: &Value, names: &[&str]) -> Result<String, String> {
    let sql = found["sql"].as_str().ok_or("a statement without SQL")?;
    let types: Vec<&str> = found["types"]
        .as_array()
        .ok_or("a statement without parameter types")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    if types.len() != names.len() {
        return Err(format!(
            "expected {} parameters, the server prepared {} ({types:?}): {sql}",
            names.len(),
            types.len()
        ));
    }
    if sql.contains(';') {
        return Err(format!(
            "a statement with a `;` cannot go in a pgbench script: {sql}"
        ));
    }
    // Highest first, so that `$1` does not eat the start of `$10`.
    let mut out = sql.to_owned();
    for index in (0..names.len()).rev() {
        out = out.replace(
            &format!("${}", index + 1),
            &format!(":{}::{}", names[index], types[index]),
        );
    }
    Ok(out)
}

/// pgbench: on PATH, else next to the newest server binaries.
pub(crate) fn binary() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("pgbench"))
            .find(|path| path.is_file())
    });
    on_path.or_else(|| {
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path().join("bin/pgbench"))
            .filter(|path| path.is_file())
            .collect();
        found.sort();
        found.pop()
    })
}

/// The statements the cluster has run so far, all databases, as
/// `pg_stat_statements` counts them (the extension is loaded by `bench-server
/// cluster`); `None` when it cannot be read. Its own query is not counted.
pub(crate) fn statements_run(pgbench: &std::path::Path, port: u16) -> Option<u64> {
    let output = Command::new(pgbench.with_file_name("psql"))
        .args(["-X", "-q", "-A", "-t", "-h", "127.0.0.1", "-U", "postgres"])
        .args(["-p", &port.to_string(), "-d", "bench", "-c"])
        .arg(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements \
             WHERE query NOT LIKE '%pg_stat_statements%'",
        )
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    String::from_utf8_lossy(&output.stdout).trim().parse().ok()
}

/// pgbench against one database of the bench's cluster.
pub(crate) struct PgBench {
    pub(crate) binary: PathBuf,
    pub(crate) port: u16,
    pub(crate) database: String,
    /// `-D name=value` definitions the scripts use.
    pub(crate) defines: Vec<(String, String)>,
    /// Where scripts and per-transaction logs go (removed after each run).
    pub(crate) dir: PathBuf,
    /// The CPU pgbench is pinned to.
    pub(crate) cpu: Option<usize>,
}

impl PgBench {
    /// Runs `script` for `seconds` with `clients` connections.
    pub(crate) fn run(
        &self,
        script: &str,
        clients: usize,
        seconds: u64,
    ) -> Result<Outcome, String> {
        let before = super::process::postgres_cpu_seconds(self.port);
        let mut outcome = run(self, script, clients, seconds)?;
        outcome.database_cpu_seconds = before
            .zip(super::process::postgres_cpu_seconds(self.port))
            .map(|(before, after)| after - before);
        Ok(outcome)
    }
}

impl Outcome {
    /// PostgreSQL's CPU time per transaction, in microseconds.
    pub(crate) fn database_micros_per_transaction(&self) -> Option<f64> {
        let seconds = self.database_cpu_seconds?;
        (self.transactions > 0).then(|| seconds * 1e6 / self.transactions as f64)
    }
}

fn run(bench: &PgBench, script: &str, clients: usize, seconds: u64) -> Result<Outcome, String> {
    let dir = &bench.dir;
    let run_dir = dir.join(format!("pgbench-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&run_dir).map_err(|e| format!("{}: {e}", run_dir.display()))?;
    let script_path = run_dir.join("script.sql");
    std::fs::write(&script_path, script).map_err(|e| format!("{}: {e}", script_path.display()))?;
    let mut command = match bench.cpu {
        Some(cpu) => {
            let mut command = Command::new("taskset");
            command.args(["-c", &cpu.to_string()]).arg(&bench.binary);
            command
        }
        None => Command::new(&bench.binary),
    };
    command
        .args(["-n", "-M", "prepared", "-h", "127.0.0.1", "-U", "postgres"])
        .arg("-p")
        .arg(bench.port.to_string())
        .arg("-c")
        .arg(clients.to_string())
        .arg("-j")
        .arg(clients.clamp(1, 2).to_string())
        .arg("-T")
        .arg(seconds.max(1).to_string())
        .arg("-f")
        .arg(&script_path)
        .arg("-l")
        .arg(format!("--log-prefix={}", run_dir.join("log").display()));
    for (name, value) in &bench.defines {
        command.arg("-D").arg(format!("{name}={value}"));
    }
    command.arg(&bench.database);
    let output = run_bounded(command, Duration::from_secs(seconds + 60))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        return Err(format!(
            "pgbench failed ({}): {}{}",
            output.status,
            stdout.trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let tps = stdout
        .lines()
        .find_map(|line| line.strip_prefix("tps = "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse::<f64>().ok())
        .ok_or_else(|| format!("no tps in pgbench's output:\n{stdout}"))?;
    let failed = stdout
        .lines()
        .find_map(|line| line.strip_prefix("number of failed transactions: "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse::<u64>().ok())
        .unwrap_or(0);
    let mut latencies = Vec::new();
    for entry in std::fs::read_dir(&run_dir).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        if !path
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.starts_with("log."))
        {
            continue;
        }
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // client_id transaction_no time_us script_no epoch epoch_us
        latencies.extend(text.lines().filter_map(|line| {
            line.split(' ')
                .nth(2)
                .and_then(|micros| micros.parse::<u32>().ok())
        }));
    }
    let _ = std::fs::remove_dir_all(&run_dir);
    latencies.sort_unstable();
    Ok(Outcome {
        tps,
        p50_ms: quantile_ms(&latencies, 0.5),
        p99_ms: quantile_ms(&latencies, 0.99),
        failed,
        transactions: latencies.len() as u64,
        database_cpu_seconds: None,
    })
}

/// The value at quantile `q` (0 to 1) of sorted microseconds, in milliseconds.
fn quantile_ms(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    f64::from(sorted[rank - 1]) / 1000.0
}

/// Runs `command` to completion, killing it past `timeout`.
fn run_bounded(mut command: Command, timeout: Duration) -> Result<std::process::Output, String> {
    use std::process::Stdio;
    let shown = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start {shown}: {e}"))?;
    let deadline = std::time::Instant::now() + timeout;
    while matches!(child.try_wait(), Ok(None)) {
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{shown} did not finish within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child
        .wait_with_output()
        .map_err(|e| format!("{shown}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_become_typed_variables_highest_first() {
        let found = serde_json::json!({
            "sql": "SELECT $1, $2 WHERE x = $1",
            "types": ["text", "bigint"],
        });
        assert_eq!(
            statement(&found, &["a", "b"]).as_deref(),
            Ok("SELECT :a::text, :b::bigint WHERE x = :a::text")
        );
        assert!(statement(&found, &["a"]).is_err());
    }
}
