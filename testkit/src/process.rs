//! What every kind of server shares: commands, ports, readiness, watchdogs.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{Error, READY_LIMIT};

/// Runs `command` to its end; an error carries what it printed.
pub(crate) fn run(command: &mut Command) -> Result<Output, Error> {
    let shown = format!("{command:?}");
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|source| Error::Io {
            what: format!("run {shown}"),
            source,
        })?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(Error::Failed {
            what: format!("{shown} ({})", output.status),
            output: printed(&output),
        })
    }
}

/// What a command printed, stdout then stderr.
pub(crate) fn printed(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Whether this process runs as root (the servers then run as their own user).
pub(crate) fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| output.stdout.trim_ascii() == b"0")
}

/// `program` run as `user` through `runuser` when there is one.
pub(crate) fn as_user(user: Option<&str>, program: &Path) -> Command {
    match user {
        Some(user) => {
            let mut command = Command::new("runuser");
            command.args(["-u", user, "--"]).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// Gives `dir` (and what is in it) to `user`.
pub(crate) fn chown(user: &str, dir: &Path) -> Result<(), Error> {
    run(Command::new("chown")
        .arg("-R")
        .arg(format!("{user}:{user}"))
        .arg(dir))
    .map(drop)
}

/// `N` distinct ports of 127.0.0.1 nobody listens on right now, each passing
/// `also_free` (a cluster node's bus port, say), drawn at random from
/// [`server_ports`].
pub(crate) fn free_ports<const N: usize>(
    also_free: impl Fn(u16) -> bool,
) -> Result<[u16; N], Error> {
    let io = |source| Error::Io {
        what: "find a free port on 127.0.0.1".to_owned(),
        source,
    };
    // Each port of the range once, from a random one on; without a range,
    // port 0: the kernel's choice.
    let candidates: Box<dyn Iterator<Item = u16>> = match server_ports() {
        Some(range) => {
            use std::hash::BuildHasher;
            let count = usize::from(range.end - range.start);
            let from = std::hash::RandomState::new().hash_one(std::time::SystemTime::now());
            let from = usize::try_from(from % count as u64).unwrap_or(0);
            Box::new(range.clone().skip(from).chain(range.take(from)))
        }
        None => Box::new(std::iter::repeat(0)),
    };
    // Held until all are found, so that no two are the same.
    let mut held = Vec::with_capacity(N);
    let mut ports = [0; N];
    let mut found = 0;
    for candidate in candidates {
        let listener = match TcpListener::bind(("127.0.0.1", candidate)) {
            Ok(listener) => listener,
            // The kernel's choice failing would fail again: said, not looped.
            Err(error) if candidate == 0 => return Err(io(error)),
            Err(_) => continue,
        };
        let port = listener.local_addr().map_err(io)?.port();
        if also_free(port) {
            ports[found] = port;
            found += 1;
        }
        held.push(listener);
        if found == N {
            return Ok(ports);
        }
    }
    Err(io(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("fewer than {N} free ports between 10000 and the ephemeral range"),
    )))
}

/// One port of 127.0.0.1 nobody listens on right now, for a server started
/// outside this crate: drawn at random from 10000 up to 10000 below the
/// kernel's ephemeral range, as every server this crate starts is given,
/// so that a server stopped and started again on it never finds it taken
/// by an outgoing connection.
pub fn free_port() -> Result<u16, Error> {
    free_ports(|_| true).map(|[port]| port)
}

/// Where servers' ports are drawn from: from 10000 up to 10000 below the
/// kernel's ephemeral range (`ip_local_port_range`, 32768 by default), so
/// that neither a server's port nor a Redis Cluster node's bus port (its
/// port + 10000) is in it. The kernel gives every outgoing connection a
/// local port from that range: a server stopped to be started again on its
/// port (a database's outage, a broker's restart) could find it taken by a
/// connection made meanwhile, as an e2e row's `pg_ctl start` once did
/// ("could not bind IPv4 address: Address already in use"). `None` when the
/// range starts too low to leave room.
fn server_ports() -> Option<std::ops::Range<u16>> {
    const FIRST: u16 = 10_000;
    let end = ephemeral_start().checked_sub(10_000)?;
    (end >= FIRST + 1_000).then_some(FIRST..end)
}

/// The first port of the kernel's ephemeral range (Linux's default, 32768,
/// where it cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Whether nothing listens on `port` of 127.0.0.1.
/// Runs `start` up to `times` times while it fails with an error `retry`
/// takes (another process took the free port it chose, between the choice and
/// the server's bind): its first success, or its last error. Every server's
/// start goes through it.
pub(crate) fn attempts<T>(
    times: usize,
    retry: impl Fn(&Error) -> bool,
    mut start: impl FnMut() -> Result<T, Error>,
) -> Result<T, Error> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match start() {
            Err(error) if attempt < times && retry(&error) => continue,
            started => return started,
        }
    }
}

pub(crate) fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Polls `probe` until it answers `Ok`; `Err(state)` means not yet, and the
/// last state is what the error shows when [`READY_LIMIT`] passes (with
/// `log()` appended: the server's own words). `gave_up` ends the wait at once
/// (the server exited).
pub(crate) fn await_ready<T>(
    what: &str,
    mut probe: impl FnMut() -> Result<T, String>,
    mut gave_up: impl FnMut() -> Option<String>,
    log: impl Fn() -> String,
) -> Result<T, Error> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        let last = match probe() {
            Ok(ready) => return Ok(ready),
            Err(state) => state,
        };
        let ended = gave_up();
        if ended.is_some() || started.elapsed() > READY_LIMIT {
            let mut last = last;
            if let Some(why) = ended {
                last = format!("{last}\n{why}");
            }
            let log = log();
            if !log.is_empty() {
                last = format!("{last}\n--- server log ---\n{log}");
            }
            return Err(Error::NotReady {
                what: what.to_owned(),
                waited: started.elapsed(),
                last,
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// The last `lines` lines of the file at `path` (empty when unreadable).
pub(crate) fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let kept: Vec<&str> = text.lines().rev().take(lines).collect();
    kept.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// The first of `names` found in `dirs`, else on `PATH`.
pub(crate) fn find_in(dirs: impl IntoIterator<Item = PathBuf>, name: &str) -> Option<PathBuf> {
    dirs.into_iter()
        .chain(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        ))
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
}

/// A `sh` that runs a script's stop part once its stdin closes: when the
/// server is dropped, or when the process that started it ends, however it
/// ends (the kernel closes the pipe). It ignores the signals that reach a
/// whole process group (Ctrl-C's `SIGINT`, `timeout`'s or a runner's
/// `SIGTERM`, `SIGHUP`), so it is not stopped before it has done its job;
/// the servers it starts install handlers of their own.
pub(crate) struct Watchdog {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Watchdog {
    /// Starts `sh -c SCRIPT sh ARGS…`; the script waits for its stdin's end
    /// with `read _ignored`, and stops what it guards after. `configure` sets
    /// the environment the script reads.
    pub(crate) fn spawn(
        script: &str,
        args: &[&std::ffi::OsStr],
        configure: impl FnOnce(&mut Command),
    ) -> Result<Self, Error> {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!("trap '' INT QUIT HUP TERM\n{script}"))
            .arg("sh")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        configure(&mut command);
        let mut child = command.spawn().map_err(|source| Error::Io {
            what: "start a watchdog (sh)".to_owned(),
            source,
        })?;
        let stdin = child.stdin.take();
        Ok(Self { child, stdin })
    }

    /// Whether the watchdog (and so, for the servers it runs itself, the
    /// server) has ended.
    pub(crate) fn has_ended(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Writes `line` to the watchdog's stdin, for a script that reads
    /// commands before the pipe's end.
    pub(crate) fn say(&mut self, line: &str) -> Result<(), Error> {
        use std::io::Write as _;
        let stdin = self.stdin.as_mut().ok_or_else(|| Error::Io {
            what: "write to a finished watchdog".to_owned(),
            source: std::io::Error::from(std::io::ErrorKind::BrokenPipe),
        })?;
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .map_err(|source| Error::Io {
                what: format!("tell the watchdog {line:?}"),
                source,
            })
    }

    /// Closes the pipe, and waits until the watchdog has stopped what it guards.
    pub(crate) fn finish(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::{ephemeral_start, free_ports, server_ports};

    /// Servers' ports are distinct, free, and below the ephemeral range by
    /// at least 10000 (a Redis Cluster node's bus port included), so no
    /// outgoing connection is ever given one.
    #[test]
    fn servers_ports_are_distinct_and_below_the_ephemeral_range() -> Result<(), super::Error> {
        let range = server_ports().ok_or_else(|| super::Error::Io {
            what: "this machine's ephemeral range starts below 21000".to_owned(),
            source: std::io::Error::other("no room for servers' ports"),
        })?;
        assert_eq!(range, 10_000..ephemeral_start() - 10_000);
        let ports: [u16; 4] = free_ports(|_| true)?;
        for (i, port) in ports.iter().enumerate() {
            assert!(range.contains(port), "{port} outside {range:?}");
            assert!(!ports[..i].contains(port), "{port} given twice: {ports:?}");
            assert!(super::port_is_free(*port), "{port} not free");
        }
        Ok(())
    }
}
