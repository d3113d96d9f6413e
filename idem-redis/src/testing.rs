//! Throwaway Redis servers for tests (feature `test-util`): one node, or a
//! Redis Cluster of three primaries or more, on free ports of 127.0.0.1.
//!
//! Each node is a `redis-server` (Debian package `redis-server`) in a fresh
//! temporary directory, with `--save ''` and `--appendonly no` (its data is
//! thrown away). It runs under a small `sh` watchdog that holds a pipe from the
//! test process: when the test process ends, however it ends (a panic, an
//! abort, a kill), the pipe closes and the watchdog stops the server and
//! deletes its directory. Dropping a [`TestRedis`] does the same at once.
//!
//! That makes one server per test binary cheap and safe: [`TestRedis::shared`]
//! and [`TestRedis::shared_cluster`] start one on first use, kept in a static
//! for the life of the binary; give each test its own key prefix
//! ([`TestRedis::fresh_prefix`]). A test that stops its server (an outage)
//! starts its own with [`TestRedis::start`].
//!
//! ```no_run
//! use idem_redis::RedisStore;
//! use idem_redis::testing::TestRedis;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let redis = TestRedis::shared_cluster();
//! let store: RedisStore = redis.fresh_store().await;
//! // The same, spelled out:
//! let same_kind = RedisStore::builder()
//!     .prefix(redis.fresh_prefix())
//!     .connect(&redis.url())
//!     .await?;
//! # Ok(())
//! # }
//! ```

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};
use std::{env, fmt, fs, io};

/// Throwaway Redis: one node or a cluster, stopped and deleted on drop (or when
/// the test process ends).
pub struct TestRedis {
    nodes: Vec<Node>,
    cluster: bool,
}

/// Why a test server could not be started or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestRedisError {
    /// `redis-server` or `redis-cli` was not found.
    #[error(
        "{binary} was not found in {searched}. Install Redis (`apt-get install redis-server`), \
         or set IDEM_REDIS_BIN to the directory that holds redis-server and redis-cli"
    )]
    BinaryMissing {
        /// The missing binary.
        binary: &'static str,
        /// Where it was looked for.
        searched: String,
    },
    /// A file system or process step failed.
    #[error("could not {what}")]
    Io {
        /// The step.
        what: String,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// A command ran and failed, or a server did not come up.
    #[error("{what}:\n{output}")]
    Failed {
        /// The step.
        what: String,
        /// What it printed, and the server log when there is one.
        output: String,
    },
}

/// A node: its port and directory, and the watchdogs of the servers started on
/// it (one per start; the live one is the last).
struct Node {
    port: u16,
    dir: PathBuf,
    watchdogs: Mutex<Vec<Watchdog>>,
}

/// The `sh` that stops a server when its stdin closes.
struct Watchdog {
    child: Child,
    stdin: Option<ChildStdin>,
}

/// How many times a node's start is tried on a fresh port, in case another
/// process took the free port first.
const START_ATTEMPTS: usize = 3;
/// How long a server may take to answer `PING`, or a cluster to be `ok`.
const READY: Duration = Duration::from_secs(20);

/// Stops the server when stdin closes, then deletes the node's directory.
const WATCHDOG: &str = r#"
"$IDEM_REDIS_SERVER" "$@" >/dev/null 2>&1 &
pid=$!
read _ignored
kill $pid 2>/dev/null
wait $pid 2>/dev/null
if [ "$IDEM_REDIS_REMOVE" = yes ]; then rm -rf "$IDEM_REDIS_DIR"; fi
"#;

static NEXT: AtomicU64 = AtomicU64::new(0);

impl TestRedis {
    /// Starts one node.
    pub fn start() -> Result<Self, TestRedisError> {
        Ok(Self {
            nodes: vec![Node::start(false)?],
            cluster: false,
        })
    }

    /// Starts a cluster of `primaries` nodes (at least 3) without replicas, and
    /// waits until every node reports `cluster_state:ok`.
    pub fn start_cluster(primaries: usize) -> Result<Self, TestRedisError> {
        Self::start_replicated_cluster(primaries, 0)
    }

    /// Starts a cluster of `primaries` primaries (at least 3), each with
    /// `replicas` replicas, and waits until every node reports
    /// `cluster_state:ok`. Nodes notice a failed peer after 2 seconds
    /// (`--cluster-node-timeout 2000`), and a replica then takes over.
    pub fn start_replicated_cluster(
        primaries: usize,
        replicas: usize,
    ) -> Result<Self, TestRedisError> {
        let count = primaries.max(3) * (1 + replicas);
        let mut nodes = Vec::with_capacity(count);
        for _ in 0..count {
            nodes.push(Node::start(true)?);
        }
        let redis = Self {
            nodes,
            cluster: true,
        };
        let mut create = Command::new(binary("redis-cli")?);
        create.arg("--cluster").arg("create");
        for node in &redis.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create
            .arg("--cluster-replicas")
            .arg(replicas.to_string())
            .arg("--cluster-yes");
        run(&mut create, "create the cluster")?;
        let deadline = Instant::now() + READY;
        for node in &redis.nodes {
            loop {
                let info = node.cli(&["CLUSTER", "INFO"]).unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(TestRedisError::Failed {
                        what: format!("the cluster node on port {} is not ok", node.port),
                        output: info,
                    });
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(redis)
    }

    /// One node shared by every test of this binary, started on first use.
    ///
    /// # Panics
    ///
    /// When it cannot start, saying why (and what to install).
    pub fn shared() -> &'static Self {
        static SHARED: OnceLock<TestRedis> = OnceLock::new();
        SHARED.get_or_init(|| {
            Self::start().unwrap_or_else(|error| panic!("cannot start redis-server: {error}"))
        })
    }

    /// A three-primary cluster shared by every test of this binary, started on
    /// first use.
    ///
    /// # Panics
    ///
    /// When it cannot start, saying why (and what to install).
    pub fn shared_cluster() -> &'static Self {
        static SHARED: OnceLock<TestRedis> = OnceLock::new();
        SHARED.get_or_init(|| {
            Self::start_cluster(3)
                .unwrap_or_else(|error| panic!("cannot start a Redis Cluster: {error}"))
        })
    }

    /// The URL a [`RedisStore`](crate::RedisStore) connects to:
    /// `redis://127.0.0.1:PORT`, or `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,…`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        if self.cluster {
            format!("redis+cluster://{}", nodes.join(","))
        } else {
            format!("redis://{}", nodes.join(","))
        }
    }

    /// The nodes' ports.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|node| node.port).collect()
    }

    /// A key prefix no other test of this process has had.
    pub fn fresh_prefix(&self) -> String {
        format!("t{}:", NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// A store on this server under a [fresh prefix](Self::fresh_prefix), with
    /// the default settings otherwise.
    ///
    /// # Panics
    ///
    /// When it cannot connect.
    pub async fn fresh_store(&self) -> crate::RedisStore {
        crate::RedisStore::builder()
            .prefix(self.fresh_prefix())
            .connect(&self.url())
            .await
            .unwrap_or_else(|error| panic!("cannot connect to the test Redis: {error}"))
    }

    /// Runs a command on every node with `redis-cli` and answers what each
    /// printed (for tests: `SCRIPT FLUSH`, `PTTL`…).
    pub fn cli(&self, args: &[&str]) -> Result<Vec<String>, TestRedisError> {
        self.nodes.iter().map(|node| node.cli(args)).collect()
    }

    /// Runs a command on the node on `port` with `redis-cli` and answers what
    /// it printed.
    pub fn cli_on(&self, port: u16, args: &[&str]) -> Result<String, TestRedisError> {
        match self.nodes.iter().find(|node| node.port == port) {
            Some(node) => node.cli(args),
            None => Err(TestRedisError::Failed {
                what: format!("no node of this server listens on port {port}"),
                output: String::new(),
            }),
        }
    }

    /// Stops every node, saving its data (`SHUTDOWN SAVE`); [`resume`](Self::resume)
    /// starts them again on the same ports with that data.
    pub fn stop(&self) -> Result<(), TestRedisError> {
        for node in &self.nodes {
            // The connection drops as the server exits: no answer to check.
            let _ = node.cli(&["SHUTDOWN", "SAVE"]);
            let deadline = Instant::now() + READY;
            while node.cli(&["PING"]).is_ok_and(|pong| pong == "PONG") {
                if Instant::now() > deadline {
                    return Err(TestRedisError::Failed {
                        what: format!("the node on port {} did not stop", node.port),
                        output: String::new(),
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// The port of the primary that holds `key`'s slot now (from `CLUSTER
    /// NODES` on a live node).
    pub fn primary_of(&self, key: &str) -> Result<u16, TestRedisError> {
        let mut failure = None;
        for node in &self.nodes {
            let (slot, nodes) = match node
                .cli(&["CLUSTER", "KEYSLOT", key])
                .and_then(|slot| Ok((slot, node.cli(&["CLUSTER", "NODES"])?)))
            {
                Ok(answers) => answers,
                Err(error) => {
                    failure = Some(error);
                    continue;
                }
            };
            let slot: u16 = slot.parse().unwrap_or(u16::MAX);
            // `id host:port@bus flags primary-id ping pong epoch state slots…`
            for line in nodes.lines() {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let is_primary = fields.get(2).is_some_and(|flags| {
                    flags.split(',').any(|flag| flag == "master")
                        && !flags.split(',').any(|flag| flag == "fail")
                });
                let holds = fields.iter().skip(8).any(|range| {
                    let (start, end) = range.split_once('-').unwrap_or((range, range));
                    matches!((start.parse::<u16>(), end.parse::<u16>()), (Ok(start), Ok(end)) if (start..=end).contains(&slot))
                });
                let port = fields
                    .get(1)
                    .and_then(|address| address.split(['@', ',']).next())
                    .and_then(|address| address.rsplit_once(':'))
                    .and_then(|(_, port)| port.parse().ok());
                if let (true, true, Some(port)) = (is_primary, holds, port) {
                    return Ok(port);
                }
            }
        }
        Err(failure.unwrap_or_else(|| TestRedisError::Failed {
            what: format!("no live primary holds the slot of {key:?}"),
            output: String::new(),
        }))
    }

    /// Stops the node on `port` at once, without saving (`SHUTDOWN NOSAVE`), as
    /// a crash would; in a cluster with replicas, one of its replicas takes
    /// over after the node timeout.
    pub fn crash_node(&self, port: u16) -> Result<(), TestRedisError> {
        let node = self
            .nodes
            .iter()
            .find(|node| node.port == port)
            .ok_or_else(|| TestRedisError::Failed {
                what: format!("no node of this server listens on port {port}"),
                output: String::new(),
            })?;
        let _ = node.cli(&["SHUTDOWN", "NOSAVE"]);
        let deadline = Instant::now() + READY;
        while node.cli(&["PING"]).is_ok_and(|pong| pong == "PONG") {
            if Instant::now() > deadline {
                return Err(TestRedisError::Failed {
                    what: format!("the node on port {port} did not stop"),
                    output: String::new(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Starts the stopped nodes again, and waits until they answer.
    pub fn resume(&self) -> Result<(), TestRedisError> {
        for node in &self.nodes {
            node.launch(self.cluster)?;
        }
        Ok(())
    }
}

impl Node {
    /// A node in a fresh directory on a free port.
    fn start(cluster: bool) -> Result<Self, TestRedisError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let port = free_port(cluster)?;
            let dir = env::temp_dir().join(format!(
                "idem-redis-{}-{}-{port}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).map_err(|source| TestRedisError::Io {
                what: format!("create {}", dir.display()),
                source,
            })?;
            let node = Self {
                port,
                dir,
                watchdogs: Mutex::new(Vec::new()),
            };
            match node.launch(cluster) {
                Ok(()) => return Ok(node),
                Err(error) if attempt >= START_ATTEMPTS => return Err(error),
                Err(_) => continue,
            }
        }
    }

    /// Starts `redis-server` under a watchdog and waits for its `PONG`.
    fn launch(&self, cluster: bool) -> Result<(), TestRedisError> {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(WATCHDOG)
            .arg("sh")
            .env("IDEM_REDIS_SERVER", binary("redis-server")?)
            .env("IDEM_REDIS_DIR", &self.dir)
            .args(["--bind", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .arg("--dir")
            .arg(&self.dir)
            .args(["--logfile", "redis.log", "--save", "", "--appendonly", "no"]);
        if cluster {
            command.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            ]);
        }
        let mut watchdogs = self
            .watchdogs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Only the first server of a node deletes its directory at the end: a
        // resumed server's data outlives the stopped one.
        command.env(
            "IDEM_REDIS_REMOVE",
            if watchdogs.is_empty() { "yes" } else { "no" },
        );
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| TestRedisError::Io {
                what: "run sh for redis-server".to_owned(),
                source,
            })?;
        let stdin = child.stdin.take();
        watchdogs.push(Watchdog { child, stdin });
        drop(watchdogs);
        let deadline = Instant::now() + READY;
        loop {
            if self.cli(&["PING"]).is_ok_and(|pong| pong == "PONG") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(TestRedisError::Failed {
                    what: format!("redis-server on port {} did not start", self.port),
                    output: fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn cli(&self, args: &[&str]) -> Result<String, TestRedisError> {
        let mut command = Command::new(binary("redis-cli")?);
        command
            .args(["-h", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .args(args);
        run(&mut command, &format!("run redis-cli {}", args.join(" ")))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let watchdogs = self
            .watchdogs
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        // Closing stdin stops each server; the first watchdog deletes the
        // directory once every later server is gone.
        for watchdog in watchdogs.iter_mut().rev() {
            drop(watchdog.stdin.take());
            let _ = watchdog.child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl fmt::Debug for TestRedis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestRedis")
            .field("ports", &self.ports())
            .field("cluster", &self.cluster)
            .finish()
    }
}

/// Runs `command`; answers its trimmed stdout, or its output as the error.
fn run(command: &mut Command, what: &str) -> Result<String, TestRedisError> {
    let output = command.output().map_err(|source| TestRedisError::Io {
        what: what.to_owned(),
        source,
    })?;
    let stdout = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    // redis-cli exits 0 on a server error reply; it prints it as `ERR …`.
    if output.status.success() && !stdout.starts_with("ERR") && !stdout.starts_with("Could not") {
        Ok(stdout)
    } else {
        Err(TestRedisError::Failed {
            what: what.to_owned(),
            output: format!("{stdout}{}", String::from_utf8_lossy(&output.stderr)),
        })
    }
}

/// `name` in `$IDEM_REDIS_BIN`, else on `PATH`.
fn binary(name: &'static str) -> Result<PathBuf, TestRedisError> {
    let mut dirs: Vec<PathBuf> = env::var_os("IDEM_REDIS_BIN")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    dirs.extend(env::split_paths(&env::var_os("PATH").unwrap_or_default()));
    dirs.iter()
        .map(|dir| dir.join(name))
        .find(|path| Path::is_file(path))
        .ok_or_else(|| TestRedisError::BinaryMissing {
            binary: name,
            searched: "IDEM_REDIS_BIN and PATH".to_owned(),
        })
}

/// A port nobody listens on; for a cluster node, its bus port (+10000) too.
fn free_port(cluster: bool) -> Result<u16, TestRedisError> {
    let bind = |port: u16| TcpListener::bind(("127.0.0.1", port));
    loop {
        let listener = bind(0).map_err(|source| TestRedisError::Io {
            what: "find a free port".to_owned(),
            source,
        })?;
        let port = listener
            .local_addr()
            .map_err(|source| TestRedisError::Io {
                what: "find a free port".to_owned(),
                source,
            })?
            .port();
        if !cluster {
            return Ok(port);
        }
        if port < 55_000 && bind(port + 10_000).is_ok() {
            return Ok(port);
        }
    }
}
