//! A throwaway PostgreSQL cluster for tests (feature `test-util`).
//!
//! [`TestCluster::start`] runs `initdb` into a fresh temporary directory and
//! starts a server on a free port of 127.0.0.1, with trust authentication and
//! durability off (it is thrown away). Dropping the cluster stops the server and
//! deletes the directory. Tests in other crates use it too (the HTTP scenarios,
//! the outage test, which [`stop`](TestCluster::stop)s and
//! [`resume`](TestCluster::resume)s the server).
//!
//! The server binaries (`initdb`, `pg_ctl`, `psql`) are looked up in
//! `$IDEM_PG_BIN`, then in the newest `/usr/lib/postgresql/*/bin`, then on
//! `PATH`. `initdb` refuses to run as root: as root, the cluster runs as the
//! `postgres` user (through `runuser`).
//!
//! A test binary should start one cluster and give each test its own database
//! ([`create_database`](TestCluster::create_database)):
//! [`TestCluster::shared`] starts the binary's cluster on first use and hands
//! out the same one after, and a watchdog process stops and deletes it once the
//! test process has exited (statics are never dropped). A test that stops the
//! server starts a cluster of its own with [`TestCluster::start`].
//!
//! ```no_run
//! use idem_diesel::testing::TestCluster;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let cluster = TestCluster::start()?;
//! cluster.create_database("replay_test")?;
//! let store = idem_diesel::PgStore::connect(&cluster.url("replay_test")).await?;
//! store.migrate().await?;
//! # Ok(())
//! # }
//! ```

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};
use std::{env, fmt, fs, io};

/// The database every cluster has.
pub const DEFAULT_DATABASE: &str = "postgres";

/// A PostgreSQL server in a temporary directory, stopped and deleted on drop.
pub struct TestCluster {
    bin: PathBuf,
    root: PathBuf,
    port: u16,
    /// `Some("postgres")` when running as root.
    run_as: Option<&'static str>,
}

/// Why a test cluster could not be started or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// No PostgreSQL server binaries were found.
    #[error(
        "PostgreSQL server binaries (initdb, pg_ctl, psql) were not found in {searched}. \
         Install PostgreSQL (`apt-get install postgresql`), or set IDEM_PG_BIN to the \
         directory that holds initdb and pg_ctl"
    )]
    BinariesMissing {
        /// Where they were looked for.
        searched: String,
    },
    /// A file system step failed.
    #[error("could not prepare {path}")]
    Io {
        /// The path concerned.
        path: PathBuf,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// A command could not be run at all.
    #[error("could not run {command}")]
    Spawn {
        /// The command.
        command: String,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// A command ran and failed.
    #[error("{command} failed ({status}):\n{output}")]
    Failed {
        /// The command.
        command: String,
        /// Its exit status.
        status: String,
        /// What it printed, and the server log when there is one.
        output: String,
    },
    /// A database name that would need quoting.
    #[error("{0:?} is not a plain database name (ASCII letters, digits, `_`)")]
    InvalidName(String),
}

/// How many times a start is tried on a fresh port, in case another process
/// took the free port first.
const START_ATTEMPTS: usize = 3;

static CLUSTERS: AtomicU64 = AtomicU64::new(0);

impl TestCluster {
    /// Creates a cluster in a fresh temporary directory and starts it.
    pub fn start() -> Result<Self, ClusterError> {
        let bin = find_binaries()?;
        let run_as = running_as_root().then_some("postgres");
        let root = env::temp_dir().join(format!(
            "idem-pg-{}-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed),
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
        ));
        fs::create_dir_all(&root).map_err(|source| ClusterError::Io {
            path: root.clone(),
            source,
        })?;
        let mut cluster = Self {
            bin,
            root,
            port: 0,
            run_as,
        };
        // From here on, dropping `cluster` removes the directory.
        if let Some(user) = run_as {
            cluster.run(
                Command::new("chown")
                    .arg(format!("{user}:{user}"))
                    .arg(&cluster.root),
            )?;
        }
        let data = cluster.data_dir();
        cluster.run(cluster.server_command("initdb").arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        ]))?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            cluster.port = free_port(&cluster.root)?;
            match cluster.resume() {
                Ok(()) => return Ok(cluster),
                Err(error) if attempt >= START_ATTEMPTS => return Err(error),
                Err(_) => continue,
            }
        }
    }

    /// The test process's shared cluster: started on first use, stopped and
    /// deleted by a watchdog process once this process has exited.
    pub fn shared() -> Result<&'static TestCluster, ClusterError> {
        static SHARED: Mutex<Option<&'static TestCluster>> = Mutex::new(None);
        let mut shared = SHARED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(cluster) = *shared {
            return Ok(cluster);
        }
        let cluster = Self::start()?;
        cluster.watch(std::process::id())?;
        let cluster: &'static TestCluster = Box::leak(Box::new(cluster));
        *shared = Some(cluster);
        Ok(cluster)
    }

    /// A unique, valid database name starting with `prefix`.
    pub fn fresh_database(&self, prefix: &str) -> Result<String, ClusterError> {
        static DATABASES: AtomicU64 = AtomicU64::new(0);
        let name = format!("{prefix}_{}", DATABASES.fetch_add(1, Ordering::Relaxed));
        self.create_database(&name)?;
        Ok(name)
    }

    /// Starts a process that stops the server and deletes the directory once
    /// the process `pid` is gone.
    fn watch(&self, pid: u32) -> Result<(), ClusterError> {
        let quote =
            |path: &Path| format!("'{}'", path.display().to_string().replace('\'', "'\\''"));
        let pg_ctl = quote(&self.bin.join("pg_ctl"));
        let as_user = self
            .run_as
            .map_or(String::new(), |user| format!("runuser -u {user} -- "));
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.2; done; \
             {as_user}{pg_ctl} -D {data} -m immediate -w stop >/dev/null 2>&1; rm -rf {root}",
            data = quote(&self.data_dir()),
            root = quote(&self.root),
        );
        Command::new("sh")
            .arg("-c")
            .arg(&script)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map(drop)
            .map_err(|source| ClusterError::Spawn {
                command: script,
                source,
            })
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
    pub fn create_database(&self, name: &str) -> Result<(), ClusterError> {
        let plain = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !plain {
            return Err(ClusterError::InvalidName(name.to_owned()));
        }
        self.psql(DEFAULT_DATABASE, &format!("CREATE DATABASE \"{name}\""))
            .map(drop)
    }

    /// Runs `sql` in `database` with `psql` and answers what it printed: one line
    /// per row, columns separated by `|`, no headers.
    pub fn psql(&self, database: &str, sql: &str) -> Result<String, ClusterError> {
        let output = self.run(
            Command::new(self.bin.join("psql"))
                .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
                .args(["-h", "127.0.0.1", "-U", "postgres"])
                .arg("-p")
                .arg(self.port.to_string())
                .args(["-d", database, "-c", sql]),
        )?;
        Ok(String::from_utf8_lossy(&output.stdout)
            .trim_end()
            .to_owned())
    }

    /// Stops the server (fast shutdown: open connections are closed), keeping its
    /// data; [`resume`](Self::resume) starts it again on the same port.
    pub fn stop(&self) -> Result<(), ClusterError> {
        self.run(
            self.server_command("pg_ctl")
                .arg("-D")
                .arg(self.data_dir())
                .args(["-m", "fast", "-w", "stop"]),
        )
        .map(drop)
    }

    /// Starts the server, and waits until it accepts connections.
    pub fn resume(&self) -> Result<(), ClusterError> {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {socket} \
             -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
             -c max_connections=300",
            port = self.port,
            socket = self.root.display(),
        );
        let started = self.run(
            self.server_command("pg_ctl")
                .arg("-D")
                .arg(self.data_dir())
                .arg("-l")
                .arg(self.log_file())
                .arg("-o")
                .arg(options)
                .args(["-w", "start"]),
        );
        started.map(drop).map_err(|error| match error {
            ClusterError::Failed {
                command,
                status,
                output,
            } => ClusterError::Failed {
                command,
                status,
                output: format!(
                    "{output}\n--- server log ---\n{}",
                    fs::read_to_string(self.log_file()).unwrap_or_default()
                ),
            },
            other => other,
        })
    }

    fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    fn log_file(&self) -> PathBuf {
        self.root.join("server.log")
    }

    /// `name` from the server binaries, run as `postgres` when we are root.
    fn server_command(&self, name: &str) -> Command {
        let program = self.bin.join(name);
        match self.run_as {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--"]).arg(program);
                command
            }
            None => Command::new(program),
        }
    }

    fn run(&self, command: &mut Command) -> Result<Output, ClusterError> {
        let shown = format!("{command:?}");
        let output = command.output().map_err(|source| ClusterError::Spawn {
            command: shown.clone(),
            source,
        })?;
        if output.status.success() {
            Ok(output)
        } else {
            Err(ClusterError::Failed {
                command: shown,
                status: output.status.to_string(),
                output: format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ),
            })
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        // `-m immediate`: nothing is worth saving; the directory goes next.
        if self.data_dir().join("postmaster.pid").exists() {
            let _ = self.run(
                self.server_command("pg_ctl")
                    .arg("-D")
                    .arg(self.data_dir())
                    .args(["-m", "immediate", "-w", "stop"]),
            );
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

impl fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestCluster")
            .field("root", &self.root)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

/// The directory holding `initdb` and `pg_ctl`.
fn find_binaries() -> Result<PathBuf, ClusterError> {
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
    Err(ClusterError::BinariesMissing {
        searched: searched.join(", "),
    })
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| output.stdout.trim_ascii() == b"0")
}

/// A port nobody listens on right now.
fn free_port(root: &Path) -> Result<u16, ClusterError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|source| ClusterError::Io {
        path: root.to_owned(),
        source,
    })?;
    listener
        .local_addr()
        .map(|address| address.port())
        .map_err(|source| ClusterError::Io {
            path: root.to_owned(),
            source,
        })
}
