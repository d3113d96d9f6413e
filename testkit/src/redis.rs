//! Throwaway Redis servers: one node, or a Redis Cluster of three primaries or
//! more, with replicas or not, on free ports of 127.0.0.1.
//!
//! Each node is a `redis-server` (Debian package `redis-server`) in a fresh
//! temporary directory, with `--save ''` and `--appendonly no` (its data is
//! thrown away), run by its watchdog. Readiness:
//!
//! - a node answers `PING` with `PONG` (not `LOADING`);
//! - a cluster: every node reports `cluster_state:ok`, all 16384 slots
//!   assigned and ok, and knows every other node;
//! - replicas ([`TestRedis::await_replicas`]): every replica reports
//!   `master_link_status:up`, no sync in progress, and a replication offset
//!   at its primary's. A test that relies on a write being on a replica
//!   calls it after writing, then checks with `WAIT`.
//!
//! ```no_run
//! use idem_testkit::TestRedis;
//!
//! let redis = TestRedis::shared_cluster();
//! let prefix = redis.fresh_prefix(); // give each test its own keys
//! println!("{} {prefix}", redis.url()); // redis+cluster://127.0.0.1:P1,…
//! ```

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::{env, fmt, fs};

use crate::Error;
use crate::process::{self, Watchdog};

/// Throwaway Redis: one node or a cluster, stopped and deleted when dropped
/// or when this process ends.
pub struct TestRedis {
    nodes: Vec<Node>,
    cluster: bool,
    /// How many replicas the cluster was created with, in all.
    replicas: usize,
}

/// A node: its port and directory, and the watchdogs of the servers started on
/// it (one per start; the live one is the last).
struct Node {
    port: u16,
    dir: PathBuf,
    watchdogs: Mutex<Vec<Watchdog>>,
}

/// How many times a node's start is tried on a fresh port, in case another
/// process took the free port first.
const START_ATTEMPTS: usize = 3;

/// Runs the server (`$@` are its arguments) until stdin closes, then stops it
/// and, for a node's first server, deletes the node's directory.
const WATCHDOG: &str = r#"
"$IDEM_REDIS_SERVER" "$@" >/dev/null 2>&1 &
pid=$!
read _ignored
kill $pid 2>/dev/null
wait $pid 2>/dev/null
if [ "$IDEM_REMOVE" = yes ]; then rm -rf "$IDEM_DIR"; fi
"#;

/// Every slot of a Redis Cluster.
const SLOTS: &str = "16384";

static PREFIXES: AtomicU64 = AtomicU64::new(0);

impl TestRedis {
    /// Starts one node, and waits until it answers `PING`.
    pub fn start() -> Result<Self, Error> {
        Ok(Self {
            nodes: vec![Node::start(false)?],
            cluster: false,
            replicas: 0,
        })
    }

    /// Starts a cluster of `primaries` nodes (at least 3) without replicas, and
    /// waits until it is [ready](self).
    pub fn start_cluster(primaries: usize) -> Result<Self, Error> {
        Self::start_replicated_cluster(primaries, 0)
    }

    /// Starts a cluster of `primaries` primaries (at least 3), each with
    /// `replicas` replicas, and waits until every node reports the cluster ok
    /// and every replica is in sync with its primary. Nodes notice a failed
    /// peer after 2 seconds (`--cluster-node-timeout 2000`), and a replica
    /// then takes over.
    pub fn start_replicated_cluster(primaries: usize, replicas: usize) -> Result<Self, Error> {
        let primaries = primaries.max(3);
        let count = primaries * (1 + replicas);
        let mut nodes = Vec::with_capacity(count);
        for _ in 0..count {
            nodes.push(Node::start(true)?);
        }
        let redis = Self {
            nodes,
            cluster: true,
            replicas: primaries * replicas,
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
        process::run(&mut create)?;
        let known = count.to_string();
        for node in &redis.nodes {
            process::await_ready(
                &format!(
                    "the cluster node on port {} reports cluster_state:ok, \
                     {SLOTS} slots ok and {known} known nodes",
                    node.port
                ),
                || {
                    let info = node.cli(&["CLUSTER", "INFO"]).map_err(|e| e.to_string())?;
                    let ready = field(&info, "cluster_state") == Some("ok")
                        && field(&info, "cluster_slots_assigned") == Some(SLOTS)
                        && field(&info, "cluster_slots_ok") == Some(SLOTS)
                        && field(&info, "cluster_known_nodes") == Some(known.as_str());
                    if ready { Ok(()) } else { Err(info) }
                },
                || None,
                || node.log(),
            )?;
        }
        redis.await_replicas()?;
        Ok(redis)
    }

    /// Waits until every replica of the cluster is linked to its primary
    /// (`master_link_status:up`, no sync in progress) and has caught up with
    /// it: its replication offset is at least the primary's. Call it after a
    /// write that a test needs on a replica (before a failover); the cluster's
    /// start calls it too.
    pub fn await_replicas(&self) -> Result<(), Error> {
        if self.replicas == 0 {
            return Ok(());
        }
        process::await_ready(
            &format!(
                "{} replicas report master_link_status:up and their primary's offset",
                self.replicas
            ),
            || {
                let mut synced = 0;
                let mut states = Vec::new();
                for node in &self.nodes {
                    let Ok(info) = node.cli(&["INFO", "replication"]) else {
                        continue; // a crashed node
                    };
                    if field(&info, "role") != Some("slave") {
                        continue;
                    }
                    let primary_offset = field(&info, "master_port")
                        .and_then(|port| port.parse::<u16>().ok())
                        .and_then(|port| self.nodes.iter().find(|n| n.port == port))
                        .and_then(|primary| primary.cli(&["INFO", "replication"]).ok())
                        .and_then(|primary| number(&primary, "master_repl_offset"));
                    let offset = number(&info, "slave_repl_offset");
                    let caught_up = matches!(
                        (offset, primary_offset),
                        (Some(offset), Some(primary)) if offset >= primary
                    );
                    if field(&info, "master_link_status") == Some("up")
                        && field(&info, "master_sync_in_progress") == Some("0")
                        && caught_up
                    {
                        synced += 1;
                    } else {
                        states.push(format!(
                            "replica on port {}: offset {offset:?}, primary's {primary_offset:?}\n{info}",
                            node.port
                        ));
                    }
                }
                if synced >= self.replicas {
                    Ok(())
                } else {
                    Err(format!("{synced} in sync\n{}", states.join("\n")))
                }
            },
            || None,
            String::new,
        )
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

    /// The URL a `RedisStore` connects to: `redis://127.0.0.1:PORT`, or
    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,…`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        let scheme = if self.cluster {
            "redis+cluster"
        } else {
            "redis"
        };
        format!("{scheme}://{}", nodes.join(","))
    }

    /// The nodes' ports.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|node| node.port).collect()
    }

    /// A key prefix no other test of this process has had.
    pub fn fresh_prefix(&self) -> String {
        format!("t{}:", PREFIXES.fetch_add(1, Ordering::Relaxed))
    }

    /// Runs a command on every node with `redis-cli` and answers what each
    /// printed (for tests: `SCRIPT FLUSH`, `PTTL`…).
    pub fn cli(&self, args: &[&str]) -> Result<Vec<String>, Error> {
        self.nodes.iter().map(|node| node.cli(args)).collect()
    }

    /// Runs a command on the node on `port` with `redis-cli` and answers what
    /// it printed.
    pub fn cli_on(&self, port: u16, args: &[&str]) -> Result<String, Error> {
        self.node(port)?.cli(args)
    }

    /// Stops every node, saving its data (`SHUTDOWN SAVE`); [`resume`](Self::resume)
    /// starts them again on the same ports with that data.
    pub fn stop(&self) -> Result<(), Error> {
        for node in &self.nodes {
            node.shutdown("SAVE")?;
        }
        Ok(())
    }

    /// The port of the primary that holds `key`'s slot now (from `CLUSTER
    /// NODES` on a live node).
    pub fn primary_of(&self, key: &str) -> Result<u16, Error> {
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
        Err(failure.unwrap_or_else(|| Error::Failed {
            what: format!("find the live primary that holds the slot of {key:?}"),
            output: String::new(),
        }))
    }

    /// Stops the node on `port` at once, without saving (`SHUTDOWN NOSAVE`), as
    /// a crash would; in a cluster with replicas, one of its replicas takes
    /// over after the node timeout.
    pub fn crash_node(&self, port: u16) -> Result<(), Error> {
        self.node(port)?.shutdown("NOSAVE")
    }

    /// Starts the stopped nodes again, and waits until they answer.
    pub fn resume(&self) -> Result<(), Error> {
        for node in &self.nodes {
            node.launch(self.cluster)?;
        }
        Ok(())
    }

    fn node(&self, port: u16) -> Result<&Node, Error> {
        self.nodes
            .iter()
            .find(|node| node.port == port)
            .ok_or_else(|| Error::Failed {
                what: format!("find the node of this server on port {port}"),
                output: String::new(),
            })
    }
}

impl Node {
    /// A node in a fresh directory on a free port.
    fn start(cluster: bool) -> Result<Self, Error> {
        process::attempts(
            START_ATTEMPTS,
            |_| true,
            || {
                // A cluster node's bus port is its port + 10000.
                let [port] = process::free_ports(|port| {
                    !cluster || (port < 55_000 && process::port_is_free(port + 10_000))
                })?;
                let node = Self {
                    port,
                    dir: crate::fresh_dir("redis")?,
                    watchdogs: Mutex::new(Vec::new()),
                };
                node.launch(cluster).map(|()| node)
            },
        )
    }

    /// Starts `redis-server` under a watchdog and waits for its `PONG`.
    fn launch(&self, cluster: bool) -> Result<(), Error> {
        let server = binary("redis-server")?;
        let port = self.port.to_string();
        let leading = ["--bind", "127.0.0.1", "--port", &port, "--dir"];
        let mut args: Vec<&OsStr> = leading.iter().map(OsStr::new).collect();
        args.push(self.dir.as_os_str());
        args.extend(
            [
                "--logfile",
                "redis.log",
                "--save",
                "",
                "--appendonly",
                "no",
                // A replica's first sync starts at once (the default waits 5 s
                // for more replicas); readiness is still waited for.
                "--repl-diskless-sync-delay",
                "0",
            ]
            .iter()
            .map(OsStr::new),
        );
        if cluster {
            args.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ]
                .iter()
                .map(OsStr::new),
            );
        }
        let mut watchdogs = self
            .watchdogs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Only the first server of a node deletes its directory at the end: a
        // resumed server's data outlives the stopped one.
        let remove = if watchdogs.is_empty() { "yes" } else { "no" };
        watchdogs.push(Watchdog::spawn(WATCHDOG, &args, |sh| {
            sh.env("IDEM_REDIS_SERVER", &server)
                .env("IDEM_DIR", &self.dir)
                .env("IDEM_REMOVE", remove);
        })?);
        drop(watchdogs);
        process::await_ready(
            &format!("redis-server on port {} answers PING with PONG", self.port),
            || match self.cli(&["PING"]) {
                Ok(pong) if pong == "PONG" => Ok(()),
                Ok(other) => Err(other),
                Err(error) => Err(error.to_string()),
            },
            || {
                let mut watchdogs = self
                    .watchdogs
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let ended = watchdogs.last_mut().is_some_and(Watchdog::has_ended);
                ended.then(|| "its watchdog ended".to_owned())
            },
            || self.log(),
        )
    }

    /// `SHUTDOWN SAVE|NOSAVE`, and waits until the node no longer answers.
    fn shutdown(&self, mode: &str) -> Result<(), Error> {
        // The connection drops as the server exits: no answer to check.
        let _ = self.cli(&["SHUTDOWN", mode]);
        process::await_ready(
            &format!("redis-server on port {} stopped", self.port),
            || match self.cli(&["PING"]) {
                Ok(pong) if pong == "PONG" => Err(pong),
                _ => Ok(()),
            },
            || None,
            || self.log(),
        )
    }

    fn cli(&self, args: &[&str]) -> Result<String, Error> {
        let mut command = Command::new(binary("redis-cli")?);
        command
            .args(["-h", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .args(args);
        let output = process::run(&mut command)?;
        let stdout = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        // redis-cli exits 0 on a server's error reply, and prints it.
        let refused = ["ERR", "Could not", "LOADING", "MASTERDOWN", "CLUSTERDOWN"];
        if refused.iter().any(|word| stdout.starts_with(word)) {
            Err(Error::Failed {
                what: format!("redis-cli -p {} {}", self.port, args.join(" ")),
                output: format!("{stdout}{}", String::from_utf8_lossy(&output.stderr)),
            })
        } else {
            Ok(stdout)
        }
    }

    fn log(&self) -> String {
        process::tail(&self.dir.join("redis.log"), 40)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let watchdogs = self
            .watchdogs
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        // Each closed pipe stops its server; the first watchdog deletes the
        // directory once every later server is gone.
        for watchdog in watchdogs.iter_mut().rev() {
            watchdog.finish();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl fmt::Debug for TestRedis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestRedis")
            .field("ports", &self.ports())
            .field("cluster", &self.cluster)
            .field("replicas", &self.replicas)
            .finish()
    }
}

/// The value of `name` in `INFO`-style `name:value` lines.
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
}

fn number(info: &str, name: &str) -> Option<i64> {
    field(info, name)?.parse().ok()
}

/// `name` in `$IDEM_REDIS_BIN`, else on `PATH`.
fn binary(name: &'static str) -> Result<PathBuf, Error> {
    let dirs = env::var_os("IDEM_REDIS_BIN").map(PathBuf::from);
    process::find_in(dirs, name).ok_or(Error::NotInstalled {
        what: name,
        searched: "IDEM_REDIS_BIN and PATH".to_owned(),
        fix: "install Redis (`apt-get install redis-server`), or set IDEM_REDIS_BIN to \
              the directory that holds redis-server and redis-cli",
    })
}
