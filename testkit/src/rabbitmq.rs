//! A throwaway RabbitMQ node.
//!
//! A node of its own (own directory, name, ports and `epmd`), on 127.0.0.1.
//! As root, the node runs as the `rabbitmq` user (through `runuser`) in a
//! directory it owns. Its AMQP port, distribution port and `epmd` port are
//! free ports of 127.0.0.1; its configuration, database, logs, feature flags
//! and plugins file are in its directory, so the system's node (if any) is
//! neither used nor disturbed. It is ready when `rabbitmqctl await_startup`
//! succeeds and its AMQP port accepts a connection. A test binary starts one
//! and gives each case a queue (or a virtual host) of its own.
//!
//! ```no_run
//! use idem_testkit::TestRabbitMq;
//!
//! let broker = TestRabbitMq::start()?;
//! println!("{}", broker.url()); // amqp://guest:guest@127.0.0.1:PORT/%2f
//! # Ok::<(), idem_testkit::Error>(())
//! ```

use std::ffi::OsStr;
use std::fs;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::Error;
use crate::process::{self, Watchdog};

/// Where Debian's `rabbitmq-server` puts the node's scripts.
const SCRIPTS: &str = "/usr/lib/rabbitmq/bin";

/// Keeps the Erlang distribution of the node and of `rabbitmqctl` on
/// 127.0.0.1.
const LOCAL_DISTRIBUTION: &str = "-kernel inet_dist_use_interface {127,0,0,1}";

/// How many times a start is tried on fresh ports.
const START_ATTEMPTS: usize = 2;

/// Once stdin closes: stops the node (`$@` is `rabbitmqctl -n NODE stop`, as
/// the node's user, with its environment), ends its `epmd`, deletes its
/// directory.
const WATCHDOG: &str = r#"
read _ignored
"$@" >/dev/null 2>&1
epmd -port "$IDEM_EPMD_PORT" -kill >/dev/null 2>&1
rm -rf "$IDEM_DIR"
"#;

/// A RabbitMQ node, stopped and deleted when dropped or when this process
/// ends.
#[derive(Debug)]
pub struct TestRabbitMq {
    root: PathBuf,
    node: String,
    port: u16,
    dist_port: u16,
    epmd_port: u16,
    /// `Some("rabbitmq")` when running as root.
    run_as: Option<&'static str>,
    server: Option<Child>,
    watchdog: Option<WatchdogHandle>,
}

/// The watchdog, kept out of `Debug`.
struct WatchdogHandle(Watchdog);

impl std::fmt::Debug for WatchdogHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Watchdog")
    }
}

impl TestRabbitMq {
    /// Starts a node in a fresh temporary directory and waits until it is
    /// ready. Tried again on fresh ports if it does not start (another
    /// process may have taken a free port first).
    pub fn start() -> Result<Self, Error> {
        if !Path::new(SCRIPTS).join("rabbitmq-server").is_file() {
            return Err(Error::NotInstalled {
                what: "RabbitMQ's server scripts",
                searched: SCRIPTS.to_owned(),
                fix: "install RabbitMQ (`apt-get install rabbitmq-server`)",
            });
        }
        process::attempts(
            START_ATTEMPTS,
            |error| matches!(error, Error::NotReady { .. }),
            Self::start_once,
        )
    }

    fn start_once() -> Result<Self, Error> {
        let run_as = process::running_as_root().then_some("rabbitmq");
        let root = crate::fresh_dir("rabbitmq")?;
        let io = |path: &Path| {
            let what = format!("prepare {}", path.display());
            move |source| Error::Io { what, source }
        };
        fs::create_dir_all(root.join("log")).map_err(io(&root))?;
        fs::write(root.join("enabled_plugins"), "[].\n").map_err(io(&root))?;
        let [port, dist_port, epmd_port] = process::free_ports(|_| true)?;
        let name = root
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut broker = Self {
            node: format!("{name}@localhost"),
            root,
            port,
            dist_port,
            epmd_port,
            run_as,
            server: None,
            watchdog: None,
        };
        // From here on, dropping `broker` stops what was started and removes
        // the directory.
        if let Some(user) = run_as {
            process::chown(user, &broker.root)?;
        }
        let mut stop = broker.command("rabbitmqctl");
        stop.args(["-n", &broker.node, "stop"]);
        let mut args: Vec<&OsStr> = vec![stop.get_program()];
        args.extend(stop.get_args());
        let envs: Vec<(&OsStr, Option<&OsStr>)> = stop.get_envs().collect();
        let watchdog = Watchdog::spawn(WATCHDOG, &args, |sh| {
            for (name, value) in envs {
                if let Some(value) = value {
                    sh.env(name, value);
                }
            }
            sh.env("IDEM_EPMD_PORT", epmd_port.to_string())
                .env("IDEM_DIR", &broker.root);
        })?;
        broker.watchdog = Some(WatchdogHandle(watchdog));
        let log = fs::File::create(broker.output()).map_err(io(&broker.root))?;
        let log_err = log.try_clone().map_err(io(&broker.root))?;
        let mut server = broker.command("rabbitmq-server");
        server
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err));
        broker.server = Some(server.spawn().map_err(|source| Error::Io {
            what: format!("start {SCRIPTS}/rabbitmq-server"),
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

    /// Runs `rabbitmqctl -n NODE ARGS…` and answers what it printed (for
    /// tests: `list_queues`, `add_vhost`…).
    pub fn ctl(&self, args: &[&str]) -> Result<String, Error> {
        let output = process::run(
            self.command("rabbitmqctl")
                .arg("-n")
                .arg(&self.node)
                .args(args),
        )?;
        Ok(String::from_utf8_lossy(&output.stdout)
            .trim_end()
            .to_owned())
    }

    /// Stops the RabbitMQ application on the node (`rabbitmqctl stop_app`),
    /// as a broker restart does: every client connection is closed and the
    /// AMQP port refuses new ones. Durable queues and persistent messages
    /// stay; the node's Erlang VM keeps running. [`start_app`](Self::start_app)
    /// starts it again.
    pub fn stop_app(&self) -> Result<(), Error> {
        self.ctl(&["stop_app"]).map(drop)
    }

    /// Starts the RabbitMQ application again after [`stop_app`](Self::stop_app)
    /// and waits until its AMQP port accepts a connection.
    pub fn start_app(&self) -> Result<(), Error> {
        self.ctl(&["start_app"])?;
        let port = self.port;
        process::await_ready(
            &format!(
                "RabbitMQ node {} takes AMQP connections on port {port} again",
                self.node
            ),
            || {
                TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(5))
                    .map(drop)
                    .map_err(|error| format!("AMQP port {port}: {error}"))
            },
            || None,
            || process::tail(&self.output(), 40),
        )
    }

    /// Waits until `rabbitmqctl await_startup` succeeds (it fails at once
    /// while the node has not registered with `epmd` yet) and the AMQP port
    /// accepts a connection.
    fn await_startup(&mut self) -> Result<(), Error> {
        let port = self.port;
        let node = self.node.clone();
        let mut ctl = self.command("rabbitmqctl");
        ctl.args(["-n", &node, "await_startup", "--timeout", "30"]);
        let output = self.output();
        let server = &mut self.server;
        process::await_ready(
            &format!("RabbitMQ node {node} runs and takes AMQP connections on port {port}"),
            || {
                process::run(&mut ctl).map_err(|error| error.to_string())?;
                TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(5))
                    .map(drop)
                    .map_err(|error| format!("AMQP port {port}: {error}"))
            },
            || match server.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(format!("rabbitmq-server exited ({status})")),
                _ => None,
            },
            || process::tail(&output, 40),
        )
    }

    fn output(&self) -> PathBuf {
        self.root.join("server.out")
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
            // The node's epmd (started by the node) accepts `epmd -kill`
            // while a node is still registered: the watchdog's kill then
            // works even when `rabbitmqctl stop` returned before the node
            // left epmd, or failed (a refused kill left idle epmds behind).
            ("ERL_EPMD_RELAXED_COMMAND_CHECK", "1".to_owned()),
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

impl Drop for TestRabbitMq {
    fn drop(&mut self) {
        match self.watchdog.take() {
            // Stops the node, ends its epmd, deletes the directory.
            Some(WatchdogHandle(mut watchdog)) => watchdog.finish(),
            None => {
                let _ = fs::remove_dir_all(&self.root);
            }
        }
        if let Some(mut server) = self.server.take() {
            // Stopped by now; killed if `rabbitmqctl stop` could not.
            let _ = server.kill();
            let _ = server.wait();
        }
    }
}
