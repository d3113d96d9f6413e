//! The processes a bench run starts, and what `/proc` says about them.

use std::io::Write;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// CPU readings from `/proc`, shared with the helpers that measure their own
/// window (`bench-server consume`).
pub(crate) use idem_testkit::cpu::{cpu_seconds, postgres_cpu_seconds};

/// A child process that announced itself on its first stdout line; killed
/// (and reaped) when dropped, whatever path the run takes.
pub(crate) struct Process {
    child: Child,
    /// Kept open so that a helper waiting on stdin keeps running; dropped first.
    stdin: Option<ChildStdin>,
    /// The first line, without its prefix.
    pub(crate) announced: String,
}

impl Process {
    /// Starts `command` and waits (up to `timeout`) for a first line starting
    /// with `prefix`. stderr goes to `log`.
    pub(crate) fn start(
        mut command: Command,
        prefix: &str,
        timeout: Duration,
        log: &Path,
    ) -> Result<Self, String> {
        let shown = format!("{command:?}");
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .map_err(|e| format!("could not start {shown}: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let rx = idem_testkit::shell::first_line(stdout);
        let mut process = Self {
            child,
            stdin,
            announced: String::new(),
        };
        let first = rx.recv_timeout(timeout).map_err(|_| {
            let exit = match process.child.try_wait() {
                Ok(Some(status)) => format!(" and exited ({status})"),
                _ => String::new(),
            };
            format!(
                "{shown} printed no `{prefix}` line{exit}; see {}",
                log.display()
            )
        })?;
        process.announced = first
            .strip_prefix(prefix)
            .ok_or_else(|| format!("{shown}: unexpected first line {first:?}"))?
            .trim()
            .to_owned();
        Ok(process)
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Closes stdin and waits up to `grace` for the process to exit by itself
    /// (the cluster helper then stops and deletes its cluster); kills it after.
    pub(crate) fn finish(mut self, grace: Duration) {
        drop(self.stdin.take());
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Drop kills what is left.
    }

    /// CPU time (user + system) the process has used so far, in seconds.
    pub(crate) fn cpu_seconds(&self) -> Option<f64> {
        cpu_seconds(self.pid())
    }

    /// The process's peak resident set (`VmHWM`), in bytes.
    pub(crate) fn peak_rss(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map(|kib| kib * 1024)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        drop(self.stdin.take());
        if matches!(self.child.try_wait(), Ok(None)) {
            // A helper that holds a cluster stops it on SIGTERM; give it a moment.
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a helper to completion (bounded by `timeout`) and answers the JSON
/// object on the last line it printed.
pub(crate) fn helper_json(mut command: Command, timeout: Duration) -> Result<Value, String> {
    let shown = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start {shown}: {e}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{shown} did not finish within {timeout:?}"));
            }
        }
    }
    let output = child
        .wait_with_output()
        .map_err(|e| format!("{shown}: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "{shown} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).map_err(|e| format!("{shown} printed {last:?}: {e}"))
}

/// A helper started in the background; its JSON answer is read when it exits.
pub(crate) struct Background {
    child: Child,
    shown: String,
}

impl Background {
    /// Starts `command`; with `stdin`, its stdin is a pipe kept open until
    /// [`close_stdin`](Self::close_stdin).
    pub(crate) fn start(mut command: Command, stdin: bool) -> Result<Self, String> {
        let shown = format!("{command:?}");
        let child = command
            .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("could not start {shown}: {e}"))?;
        Ok(Self { child, shown })
    }

    /// Closes its stdin (a load run then ends its window).
    pub(crate) fn close_stdin(&mut self) {
        drop(self.child.stdin.take());
    }

    /// Whether it has exited.
    pub(crate) fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits up to `timeout` and answers its JSON line.
    pub(crate) fn answer(mut self, timeout: Duration) -> Result<Value, String> {
        let deadline = Instant::now() + timeout;
        while !self.exited() {
            if Instant::now() >= deadline {
                return Err(format!("{} did not finish within {timeout:?}", self.shown));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut stdout = String::new();
        let mut stderr = String::new();
        if let Some(mut out) = self.child.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut out, &mut stdout);
        }
        if let Some(mut err) = self.child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut err, &mut stderr);
        }
        let status = self.child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!(
                "{} failed ({status}): {}",
                self.shown,
                stderr.trim()
            ));
        }
        let last = stdout.lines().last().unwrap_or_default();
        serde_json::from_str(last).map_err(|e| format!("{} printed {last:?}: {e}", self.shown))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Whether `taskset` can pin processes here.
pub(crate) fn can_pin() -> bool {
    Command::new("taskset")
        .args(["-c", "0", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// The 1-minute load average.
pub(crate) fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// Writes `text` to `path`, creating its directory.
pub(crate) fn write_file(path: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let mut file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    file.write_all(text.as_bytes())
        .map_err(|e| format!("{}: {e}", path.display()))
}
