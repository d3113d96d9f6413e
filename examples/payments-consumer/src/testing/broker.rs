//! A throwaway RabbitMQ node.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Where Debian's `rabbitmq-server` puts the node's scripts.
const SCRIPTS: &str = "/usr/lib/rabbitmq/bin";

/// How long the node may take to start (about 4 s here).
const STARTUP_LIMIT: Duration = Duration::from_secs(60);

/// Keeps the Erlang distribution of the node and of `rabbitmqctl` on
/// 127.0.0.1.
const LOCAL_DISTRIBUTION: &str = "-kernel inet_dist_use_interface {127,0,0,1}";

/// How many times a start is tried.
const START_ATTEMPTS: usize = 2;

static NODES: AtomicU64 = AtomicU64::new(0);

/// A RabbitMQ node of its own (own directory, name, ports and `epmd`), on
/// 127.0.0.1; stopped and deleted on drop, a panic's unwinding included.
///
/// As root, the node runs as the `rabbitmq` user (through `runuser`) in a
/// directory it owns. Its AMQP port, distribution port and `epmd` port are
/// free ports of 127.0.0.1; its configuration, database, logs, feature flags
/// and plugins file are in its directory, so the system's node (if any) is
/// neither used nor disturbed. A test binary starts one and gives each case a
/// queue name of its own.
///
/// ```no_run
/// use payments_consumer::testing::TestBroker;
///
/// let broker = TestBroker::start()?;
/// println!("{}", broker.url()); // amqp://guest:guest@127.0.0.1:PORT/%2f
/// # Ok::<(), payments_consumer::testing::BrokerError>(())
/// ```
#[derive(Debug)]
pub struct TestBroker {
    root: PathBuf,
    node: String,
    port: u16,
    dist_port: u16,
    epmd_port: u16,
    /// `Some("rabbitmq")` when running as root.
    run_as: Option<&'static str>,
    server: Option<Child>,
}

/// Why a test broker could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// RabbitMQ is not installed.
    #[error(
        "RabbitMQ's server scripts were not found in {SCRIPTS}: install it \
         (`apt-get install rabbitmq-server`)"
    )]
    NotInstalled,
    /// A file system step failed.
    #[error("could not prepare {path}")]
    Io {
        /// The path concerned.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// A command could not be run, or failed.
    #[error("{command} failed: {output}")]
    Failed {
        /// The command.
        command: String,
        /// What it printed.
        output: String,
    },
    /// The node did not start in time.
    #[error("the RabbitMQ node did not start within {limit:?}; its log:\n{log}")]
    Startup {
        /// How long it was given.
        limit: Duration,
        /// The end of its output.
        log: String,
    },
}

impl TestBroker {
    /// Starts a node in a fresh temporary directory and waits until it runs.
    /// Tried again on fresh ports if it does not start (another process may
    /// have taken a free port first).
    pub fn start() -> Result<Self, BrokerError> {
        if !Path::new(SCRIPTS).join("rabbitmq-server").is_file() {
            return Err(BrokerError::NotInstalled);
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once() {
                Err(BrokerError::Startup { .. }) if attempt < START_ATTEMPTS => continue,
                started => return started,
            }
        }
    }

    fn start_once() -> Result<Self, BrokerError> {
        let run_as = running_as_root().then_some("rabbitmq");
        let id = format!(
            "{}-{}-{}",
            std::process::id(),
            NODES.fetch_add(1, Ordering::Relaxed),
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
        );
        let root = std::env::temp_dir().join(format!("idem-rabbitmq-{id}"));
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| BrokerError::Io { path, source }
        };
        fs::create_dir_all(root.join("log")).map_err(io(&root))?;
        fs::write(root.join("enabled_plugins"), "[].\n").map_err(io(&root))?;
        let [port, dist_port, epmd_port] = free_ports().map_err(io(&root))?;
        let mut broker = Self {
            root,
            node: format!("idem-test-{id}@localhost"),
            port,
            dist_port,
            epmd_port,
            run_as,
            server: None,
        };
        // From here on, dropping `broker` stops what was started and removes
        // the directory.
        if let Some(user) = run_as {
            run(Command::new("chown")
                .arg("-R")
                .arg(format!("{user}:{user}"))
                .arg(&broker.root))?;
        }
        let log = fs::File::create(broker.root.join("server.out")).map_err(io(&broker.root))?;
        let log_err = log.try_clone().map_err(io(&broker.root))?;
        let mut server = broker.command("rabbitmq-server");
        server
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err));
        broker.server = Some(server.spawn().map_err(|source| BrokerError::Io {
            path: PathBuf::from(SCRIPTS).join("rabbitmq-server"),
            source,
        })?);
        broker.await_startup()?;
        Ok(broker)
    }

    /// The AMQP URL of the default virtual host, as the `guest` user.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The node's AMQP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The node's directory (its logs are in `log/`).
    pub fn dir(&self) -> &Path {
        &self.root
    }

    /// Waits until `rabbitmqctl await_startup` succeeds (it fails at once
    /// while the node has not registered with `epmd` yet).
    fn await_startup(&mut self) -> Result<(), BrokerError> {
        let started = Instant::now();
        loop {
            let awaited = run(self.command("rabbitmqctl").args([
                "-n",
                &self.node,
                "await_startup",
                "--timeout",
                "30",
            ]));
            if awaited.is_ok() {
                return Ok(());
            }
            let exited = self
                .server
                .as_mut()
                .is_some_and(|server| !matches!(server.try_wait(), Ok(None)));
            if exited || started.elapsed() > STARTUP_LIMIT {
                let output = fs::read_to_string(self.root.join("server.out")).unwrap_or_default();
                let tail: Vec<&str> = output.lines().rev().take(40).collect();
                return Err(BrokerError::Startup {
                    limit: STARTUP_LIMIT,
                    log: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
                });
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// One of the node's scripts, with the node's environment, as `rabbitmq`
    /// when we are root.
    fn command(&self, script: &str) -> Command {
        let dir = |name: &str| self.root.join(name).display().to_string();
        let environment = [
            ("HOME", self.root.display().to_string()),
            ("RABBITMQ_NODENAME", self.node.clone()),
            ("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1".to_owned()),
            ("RABBITMQ_NODE_PORT", self.port.to_string()),
            ("RABBITMQ_DIST_PORT", self.dist_port.to_string()),
            ("ERL_EPMD_PORT", self.epmd_port.to_string()),
            ("ERL_EPMD_ADDRESS", "127.0.0.1".to_owned()),
            ("RABBITMQ_MNESIA_BASE", dir("mnesia")),
            ("RABBITMQ_LOG_BASE", dir("log")),
            ("RABBITMQ_FEATURE_FLAGS_FILE", dir("feature_flags")),
            ("RABBITMQ_ENABLED_PLUGINS_FILE", dir("enabled_plugins")),
            ("RABBITMQ_PID_FILE", dir("rabbitmq.pid")),
            // Files that do not exist: the system's configuration stays out.
            ("RABBITMQ_CONFIG_FILE", dir("rabbitmq")),
            ("RABBITMQ_ADVANCED_CONFIG_FILE", dir("advanced.config")),
            ("RABBITMQ_CONF_ENV_FILE", dir("rabbitmq-env.conf")),
            (
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                LOCAL_DISTRIBUTION.to_owned(),
            ),
            ("RABBITMQ_CTL_ERL_ARGS", LOCAL_DISTRIBUTION.to_owned()),
        ];
        let program = Path::new(SCRIPTS).join(script);
        let mut command = match self.run_as {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--", "env"]);
                command.args(
                    environment
                        .iter()
                        .map(|(name, value)| format!("{name}={value}")),
                );
                command.arg(program);
                command
            }
            None => {
                let mut command = Command::new(program);
                command.envs(environment);
                command
            }
        };
        command.current_dir(&self.root);
        command
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = run(self.command("rabbitmqctl").args(["-n", &self.node, "stop"]));
            let deadline = Instant::now() + Duration::from_secs(15);
            while matches!(server.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = server.kill();
            let _ = server.wait();
        }
        // The node started an `epmd` of its own on its port: end it.
        let _ = Command::new("epmd")
            .args(["-port", &self.epmd_port.to_string(), "-kill"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = fs::remove_dir_all(&self.root);
    }
}

fn run(command: &mut Command) -> Result<Output, BrokerError> {
    let shown = format!("{command:?}");
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|error| BrokerError::Failed {
            command: shown.clone(),
            output: error.to_string(),
        })?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(BrokerError::Failed {
            command: shown,
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        })
    }
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| output.stdout.trim_ascii() == b"0")
}

/// Three distinct ports nobody listens on right now.
fn free_ports() -> std::io::Result<[u16; 3]> {
    let listeners = [
        TcpListener::bind("127.0.0.1:0")?,
        TcpListener::bind("127.0.0.1:0")?,
        TcpListener::bind("127.0.0.1:0")?,
    ];
    let mut ports = [0; 3];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener.local_addr()?.port();
    }
    Ok(ports)
}
