//! A throwaway PostgreSQL cluster.
//!
//! [`TestPostgres::start`] runs `initdb` into a fresh temporary directory and
//! starts a server on a free port of 127.0.0.1, with trust authentication and
//! durability off (it is thrown away). It is ready when `pg_ctl -w start` has
//! seen it accept connections and a `SELECT 1` has answered.
//!
//! The server binaries (`initdb`, `pg_ctl`, `psql`) are looked up in
//! `$IDEM_PG_BIN`, then in the newest `/usr/lib/postgresql/*/bin`, then on
//! `PATH`. `initdb` refuses to run as root: as root, the cluster runs as the
//! `postgres` user (through `runuser`), in a directory it owns.
//!
//! A test binary starts one cluster ([`TestPostgres::shared`]) and gives each
//! test its own database ([`fresh_database`](TestPostgres::fresh_database));
//! a test that stops the server (an outage) starts one of its own.
//!
//! ```no_run
//! use idem_testkit::TestPostgres;
//!
//! let cluster = TestPostgres::shared()?;
//! let database = cluster.fresh_database("replay")?;
//! println!("{}", cluster.url(&database)); // postgres://postgres@127.0.0.1:PORT/replay_0
//! # Ok::<(), idem_testkit::Error>(())
//! ```

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::{env, fmt, fs};

use crate::process::{self, Watchdog};
use crate::{Error, READY_LIMIT};

/// The database every cluster has.
pub const DEFAULT_DATABASE: &str = "postgres";

/// How many times a start is tried on a fresh port, in case another process
/// took the free port first.
const START_ATTEMPTS: usize = 3;

/// Stops the server at once (`-m immediate`: nothing is worth saving) once
/// stdin closes, then deletes the directory. `$@` is `pg_ctl -D DATA`, run as
/// the cluster's user.
const WATCHDOG: &str = r#"
read _ignored
"$@" -m immediate -w stop >/dev/null 2>&1
rm -rf "$IDEM_DIR"
"#;

/// A PostgreSQL server in a temporary directory, stopped and deleted when
/// dropped or when this process ends.
pub struct TestPostgres {
    bin: PathBuf,
    root: PathBuf,
    port: u16,
    /// `Some("postgres")` when running as root.
    run_as: Option<&'static str>,
    watchdog: Option<Watchdog>,
}

impl TestPostgres {
    /// Creates a cluster in a fresh temporary directory, starts it, and waits
    /// until it answers a query.
    pub fn start() -> Result<Self, Error> {
        let bin = find_binaries()?;
        let run_as = process::running_as_root().then_some("postgres");
        let mut cluster = Self {
            bin,
            root: crate::fresh_dir("pg")?,
            port: 0,
            run_as,
            watchdog: None,
        };
        // From here on, dropping `cluster` removes the directory.
        if let Some(user) = run_as {
            process::chown(user, &cluster.root)?;
        }
        let data = cluster.data_dir();
        process::run(cluster.server_command("initdb").arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        ]))?;
        let mut stop = cluster.server_command("pg_ctl");
        stop.arg("-D").arg(&data);
        let mut args: Vec<&OsStr> = vec![stop.get_program()];
        args.extend(stop.get_args());
        let root = cluster.root.clone();
        cluster.watchdog = Some(Watchdog::spawn(WATCHDOG, &args, |sh| {
            sh.env("IDEM_DIR", &root);
        })?);
        process::attempts(
            START_ATTEMPTS,
            |_| true,
            || {
                let [port] = process::free_ports(|_| true)?;
                cluster.port = port;
                cluster.resume()
            },
        )?;
        Ok(cluster)
    }

    /// The test process's shared cluster: started on first use, the same one
    /// after; its watchdog stops and deletes it once this process has ended
    /// (statics are never dropped).
    pub fn shared() -> Result<&'static TestPostgres, Error> {
        static SHARED: Mutex<Option<&'static TestPostgres>> = Mutex::new(None);
        let mut shared = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(cluster) = *shared {
            return Ok(cluster);
        }
        let cluster: &'static TestPostgres = Box::leak(Box::new(Self::start()?));
        *shared = Some(cluster);
        Ok(cluster)
    }

    /// A unique, valid database name starting with `prefix`, created.
    pub fn fresh_database(&self, prefix: &str) -> Result<String, Error> {
        static DATABASES: AtomicU64 = AtomicU64::new(0);
        let name = format!("{prefix}_{}", DATABASES.fetch_add(1, Ordering::Relaxed));
        self.create_database(&name)?;
        Ok(name)
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of `database`, as the `postgres` superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Creates an empty database named `name` (ASCII letters, digits, `_`).
    pub fn create_database(&self, name: &str) -> Result<(), Error> {
        let plain = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !plain {
            return Err(Error::InvalidName(name.to_owned()));
        }
        self.psql(DEFAULT_DATABASE, &format!("CREATE DATABASE \"{name}\""))
            .map(drop)
    }

    /// Runs `sql` in `database` with `psql` and answers what it printed: one line
    /// per row, columns separated by `|`, no headers.
    pub fn psql(&self, database: &str, sql: &str) -> Result<String, Error> {
        let output = self.psql_output(database, sql)?;
        Ok(String::from_utf8_lossy(&output.stdout)
            .trim_end()
            .to_owned())
    }

    /// Stops the server (fast shutdown: open connections are closed), keeping its
    /// data; [`resume`](Self::resume) starts it again on the same port.
    pub fn stop(&self) -> Result<(), Error> {
        process::run(
            self.server_command("pg_ctl")
                .arg("-D")
                .arg(self.data_dir())
                .args(["-m", "fast", "-w", "stop"]),
        )
        .map(drop)
    }

    /// Starts the server, and waits until it answers a query.
    pub fn resume(&self) -> Result<(), Error> {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {socket} \
             -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
             -c max_connections=300",
            port = self.port,
            socket = self.root.display(),
        );
        process::run(
            self.server_command("pg_ctl")
                .arg("-D")
                .arg(self.data_dir())
                .arg("-l")
                .arg(self.log_file())
                .arg("-o")
                .arg(options)
                .args(["-t", &READY_LIMIT.as_secs().to_string()])
                .args(["-w", "start"]),
        )
        .map_err(|error| self.with_log(error))?;
        // `pg_ctl -w` has seen the server accept connections; a query proves
        // it serves them.
        process::await_ready(
            &format!("PostgreSQL on port {} answers SELECT 1", self.port),
            || match self.psql_output(DEFAULT_DATABASE, "SELECT 1") {
                Ok(_) => Ok(()),
                Err(error) => Err(error.to_string()),
            },
            || None,
            || process::tail(&self.log_file(), 40),
        )
    }

    fn psql_output(&self, database: &str, sql: &str) -> Result<Output, Error> {
        process::run(
            Command::new(self.bin.join("psql"))
                .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
                .args(["-h", "127.0.0.1", "-U", "postgres"])
                .arg("-p")
                .arg(self.port.to_string())
                .args(["-d", database, "-c", sql]),
        )
    }

    fn with_log(&self, error: Error) -> Error {
        match error {
            Error::Failed { what, output } => Error::Failed {
                what,
                output: format!(
                    "{output}\n--- server log ---\n{}",
                    process::tail(&self.log_file(), 40)
                ),
            },
            other => other,
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    fn log_file(&self) -> PathBuf {
        self.root.join("server.log")
    }

    /// `name` from the server binaries, run as `postgres` when we are root.
    fn server_command(&self, name: &str) -> Command {
        process::as_user(self.run_as, &self.bin.join(name))
    }
}

impl Drop for TestPostgres {
    fn drop(&mut self) {
        match self.watchdog.as_mut() {
            Some(watchdog) => watchdog.finish(),
            None => {
                let _ = fs::remove_dir_all(&self.root);
            }
        }
    }
}

impl fmt::Debug for TestPostgres {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestPostgres")
            .field("root", &self.root)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

/// The directory holding `initdb` and `pg_ctl` (and `psql`).
pub(crate) fn find_binaries() -> Result<PathBuf, Error> {
    let mut searched = Vec::new();
    let has_server = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    if let Some(dir) = env::var_os("IDEM_PG_BIN") {
        let dir = PathBuf::from(dir);
        if has_server(&dir) {
            return Ok(dir);
        }
        searched.push(format!("IDEM_PG_BIN={}", dir.display()));
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, dir)| has_server(dir))
        .collect();
    versions.sort();
    if let Some((_, dir)) = versions.pop() {
        return Ok(dir);
    }
    searched.push("/usr/lib/postgresql/*/bin".to_owned());
    for dir in env::split_paths(&env::var_os("PATH").unwrap_or_default()) {
        if has_server(&dir) {
            return Ok(dir);
        }
    }
    searched.push("PATH".to_owned());
    Err(Error::NotInstalled {
        what: "PostgreSQL's server binaries (initdb, pg_ctl, psql)",
        searched: searched.join(", "),
        fix: "install PostgreSQL (`apt-get install postgresql`), or set IDEM_PG_BIN \
              to the directory that holds initdb and pg_ctl",
    })
}
