//! A throwaway PostgreSQL cluster on 127.0.0.1, one database per scenario.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A running cluster in its own directory; stopped and removed when dropped.
pub(crate) struct Cluster {
    dir: PathBuf,
    port: u16,
    bin: PathBuf,
    /// PostgreSQL refuses to run as root: as root, its tools run as `postgres`.
    as_postgres: bool,
    databases: AtomicUsize,
    /// `CREATE DATABASE` copies `template1`, which must be idle: one at a time.
    creating: Mutex<()>,
}

impl Cluster {
    /// Creates a cluster in `dir` (which must not exist) and starts it on a free port.
    pub(crate) fn start(dir: &Path) -> Result<Self, String> {
        let bin = server_binaries()?;
        let as_postgres = running_as_root();
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        if as_postgres {
            succeed(
                "chown",
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(dir),
            )?;
        }
        let cluster = Self {
            dir: dir.to_owned(),
            port: free_port()?,
            bin,
            as_postgres,
            databases: AtomicUsize::new(0),
            creating: Mutex::new(()),
        };
        succeed(
            "initdb",
            cluster.tool("initdb").arg("-D").arg(cluster.data()).args([
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
            ]),
        )?;
        cluster.resume()?;
        Ok(cluster)
    }

    /// Starts the stopped cluster again, on the same port.
    pub(crate) fn resume(&self) -> Result<(), String> {
        // Durability is not under test here; speed is welcome on 2 cores.
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -k {} -c max_connections=400 \
             -c fsync=off -c synchronous_commit=off -c full_page_writes=off",
            self.port,
            self.dir.display()
        );
        succeed(
            "pg_ctl start",
            self.tool("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .arg("-l")
                .arg(self.dir.join("postgres.log"))
                .args(["-o", &options, "-w", "start"]),
        )
    }

    /// Stops the cluster the way an operator would (`-m fast`: clients are cut off).
    pub(crate) fn stop(&self) -> Result<(), String> {
        succeed(
            "pg_ctl stop",
            self.tool("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .args(["-m", "fast", "-w", "stop"]),
        )
    }

    /// Creates a fresh database and answers its URL.
    pub(crate) fn create_database(&self) -> Result<String, String> {
        let name = format!("e2e_{}", self.databases.fetch_add(1, Ordering::Relaxed) + 1);
        {
            let _one_at_a_time = self.creating.lock().map_err(|e| e.to_string())?;
            self.query("postgres", &format!("CREATE DATABASE {name}"))?;
        }
        Ok(format!(
            "postgres://postgres@127.0.0.1:{}/{name}",
            self.port
        ))
    }

    /// Runs `sql` in `database` (a name or a URL from [`Cluster::create_database`])
    /// and answers psql's unaligned output.
    pub(crate) fn query(&self, database: &str, sql: &str) -> Result<String, String> {
        let database = database.rsplit('/').next().unwrap_or(database);
        let output = run(
            "psql",
            Command::new(self.bin.join("psql"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(["-U", "postgres", "-d", database])
                .args(["-v", "ON_ERROR_STOP=1", "-X", "-A", "-t", "-c", sql]),
        )?;
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn tool(&self, name: &str) -> Command {
        let path = self.bin.join(name);
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            Command::new(path)
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.stop();
        // Tens of megabytes per cluster; its log stays for a failed run.
        let _ = std::fs::remove_dir_all(self.data());
    }
}

/// The directory of `initdb` and `pg_ctl`: `PG_BIN`, else the newest Debian
/// install, else whatever `pg_config` names.
fn server_binaries() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os("PG_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let mut installs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists())
        .collect();
    installs.sort_by_key(|bin| {
        bin.parent()
            .and_then(Path::file_name)
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
    });
    if let Some(newest) = installs.pop() {
        return Ok(newest);
    }
    let output = run(
        "pg_config --bindir",
        Command::new("pg_config").arg("--bindir"),
    )
    .map_err(|e| format!("no PostgreSQL server found (set PG_BIN): {e}"))?;
    Ok(PathBuf::from(
        String::from_utf8_lossy(&output.stdout).trim(),
    ))
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// A port outside the range the kernel draws outgoing connections' ports
/// from ([`idem_testkit::free_port`]): the outage rows stop the cluster and
/// start it again on the same port, which a connection made meanwhile could
/// otherwise have taken.
fn free_port() -> Result<u16, String> {
    idem_testkit::free_port().map_err(|e| format!("no free port: {e}"))
}

fn succeed(step: &str, command: &mut Command) -> Result<(), String> {
    run(step, command).map(|_| ())
}

/// Runs `command` to completion; an error quotes what it printed.
fn run(step: &str, command: &mut Command) -> Result<Output, String> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{step}: could not start: {e}"))?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(format!(
            "{step} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout).trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}
