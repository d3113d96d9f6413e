//! A throwaway Kafka-compatible broker: `tansu` (Apache-2.0, on crates.io),
//! a broker written in Rust, with its in-memory storage, or, for the cases
//! that restart it, its SQLite storage ([`TestKafka::start_durable`]).
//!
//! No Kafka comes from Debian, and no Java package from a registry this
//! project may use; `tansu` builds from crates.io. It is built once per
//! machine, pinned, into the cache outside the checkout (`cargo xtask ci` does it:
//! [`TANSU_VERSION`], [`install_command`]), and found there, or at
//! `IDEM_TANSU`, or on `PATH`. The broker listens on a free port of
//! 127.0.0.1 and advertises that address; it is ready when it answers a
//! connection (it reports ready within milliseconds). A test binary starts
//! one and gives each case a topic of its own.
//!
//! ```no_run
//! use idem_testkit::TestKafka;
//!
//! let broker = TestKafka::start()?;
//! println!("{}", broker.servers()); // 127.0.0.1:PORT
//! # Ok::<(), idem_testkit::Error>(())
//! ```

use std::ffi::OsStr;
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use crate::Error;
use crate::process::{self, Watchdog};
use crate::shell::cache_dir;

/// The `tansu` release the tests run against.
pub const TANSU_VERSION: &str = "0.6.0";

/// How many times a start is tried on a fresh port.
const START_ATTEMPTS: usize = 2;

/// Runs the broker in its directory; reads `stop` and `start` lines (a
/// restart, [`TestKafka::stop_broker`], [`TestKafka::start_broker`]); once
/// stdin closes, stops the broker and deletes its directory. The broker is
/// stopped with SIGKILL: on SIGTERM tansu 0.6 keeps serving the connections
/// it has until their clients leave, and a crash is the harder restart.
const WATCHDOG: &str = r#"
cd "$IDEM_DIR" || exit 1
pid=
start() { "$IDEM_TANSU_BIN" "$@" >>"$IDEM_DIR/tansu.log" 2>&1 & pid=$!; }
stop() { if [ -n "$pid" ]; then kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null; pid=; fi; }
start "$@"
while read -r line; do
  case "$line" in
    stop) stop ;;
    start) [ -n "$pid" ] || start "$@" ;;
  esac
done
stop
rm -rf "$IDEM_DIR"
"#;

/// The storage of a broker that keeps its records across a restart: a
/// SQLite file in its directory (tansu's `libsql` engine).
const DURABLE: &str = "sqlite://tansu.db";
/// The in-memory storage.
const IN_MEMORY: &str = "memory://tansu/";

static TOPICS: AtomicU64 = AtomicU64::new(0);

/// A `tansu` broker with in-memory storage (or SQLite storage,
/// [`start_durable`](Self::start_durable)), stopped when dropped or when
/// this process ends.
pub struct TestKafka {
    port: u16,
    dir: PathBuf,
    watchdog: Mutex<Watchdog>,
}

impl std::fmt::Debug for TestKafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestKafka")
            .field("port", &self.port)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Where `cargo xtask ci` installs `tansu`: `tansu-VERSION` in the cache
/// outside the checkout ([`cache_dir`]: `~/.cache/idem` unless
/// `IDEM_CI_CACHE` says otherwise), its binary in `bin/`; so every checkout,
/// and CI's clean clones, build it once per machine.
pub fn install_root() -> PathBuf {
    cache_dir().join(format!("tansu-{TANSU_VERSION}-{FEATURES_TAG}"))
}

/// What the cached build's features are called in its directory's name: a
/// build with other features is another build.
const FEATURES_TAG: &str = "libsql";

/// The `cargo install` arguments that build `tansu` into [`install_root`]:
/// pinned, with its lock file, with the in-memory storage engine and the
/// SQLite one (`libsql`: a broker that restarts keeping its records), as a dev
/// build (`--debug`: unoptimized compiles in about half the time of a
/// release build, and a test broker carries little load). [`INSTALL_ENV`]
/// goes with them.
pub fn install_command() -> Vec<String> {
    [
        "install",
        "--debug",
        "--locked",
        "tansu",
        "--version",
        TANSU_VERSION,
        "--features",
        "dynostore,libsql",
        "--root",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([install_root().display().to_string()])
    .collect()
}

/// The environment of [`install_command`]: no debug information (nothing
/// debugs the broker; it is most of a dev build's size and link time).
pub const INSTALL_ENV: &[(&str, &str)] = &[("CARGO_PROFILE_DEV_DEBUG", "0")];

/// The `tansu` binary: `IDEM_TANSU`, else [`install_root`]'s, else on
/// `PATH`.
pub fn binary() -> Result<PathBuf, Error> {
    if let Some(path) = std::env::var_os("IDEM_TANSU").map(PathBuf::from)
        && path.is_file()
    {
        return Ok(path);
    }
    process::find_in([install_root().join("bin")], "tansu").ok_or(Error::NotInstalled {
        what: "tansu (a Kafka-compatible broker)",
        searched: format!("IDEM_TANSU, {}/bin and PATH", install_root().display()),
        fix: "run `cargo xtask kafka-broker` (it runs `cargo install --debug --locked tansu --version \
              0.6.0 --features dynostore,libsql --root ~/.cache/idem/tansu-0.6.0-libsql`, about 8 \
              minutes once), or set IDEM_TANSU to a tansu binary built with those features",
    })
}

impl TestKafka {
    /// Starts a broker on a free port, and waits until it takes connections.
    ///
    /// Its in-memory engine answers a fetch that starts inside a batch of
    /// records with the next batch, skipping the rest of that one (Kafka
    /// serves the batch from the requested offset on). Cases that produce
    /// several records at once (a relay, a producer's `linger.ms`) and then
    /// consume from a stored position in the middle of them take
    /// [`start_durable`](Self::start_durable), whose engine stores each record.
    pub fn start() -> Result<Self, Error> {
        Self::start_on(IN_MEMORY)
    }

    /// Starts a broker that keeps its records in a SQLite file of its
    /// directory, so that [`stop_broker`](Self::stop_broker) then
    /// [`start_broker`](Self::start_broker) is a restart that loses nothing
    /// (slower than [`start`](Self::start): give it the cases that restart
    /// it).
    pub fn start_durable() -> Result<Self, Error> {
        Self::start_on(DURABLE)
    }

    fn start_on(storage: &str) -> Result<Self, Error> {
        let tansu = binary()?;
        process::attempts(
            START_ATTEMPTS,
            |_| true,
            || {
                let [port] = process::free_ports(|_| true)?;
                let dir = crate::fresh_dir("kafka")?;
                Self::launch(&tansu, port, dir, storage)
            },
        )
    }

    fn launch(tansu: &PathBuf, port: u16, dir: PathBuf, storage: &str) -> Result<Self, Error> {
        let url = format!("tcp://127.0.0.1:{port}");
        let args = [
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
            "--storage-engine",
            storage,
        ];
        let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
        let mut watchdog = Watchdog::spawn(WATCHDOG, &args, |sh| {
            sh.env("IDEM_TANSU_BIN", tansu).env("IDEM_DIR", &dir);
        })?;
        await_accepting(port, &dir, &mut watchdog)?;
        Ok(Self {
            port,
            dir,
            watchdog: Mutex::new(watchdog),
        })
    }

    /// Kills the broker's process (SIGKILL: its clients' connections reset,
    /// its port refusing new ones) and waits until the port refuses; the
    /// directory, and with a durable broker its committed records, stay.
    pub fn stop_broker(&self) -> Result<(), Error> {
        self.watchdog
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .say("stop")?;
        let address = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        process::await_ready(
            &format!("tansu on port {} refuses connections", self.port),
            || match TcpStream::connect_timeout(&address, Duration::from_millis(200)) {
                Ok(_) => Err("it still takes connections".to_owned()),
                Err(_) => Ok(()),
            },
            || None,
            || process::tail(&self.dir.join("tansu.log"), 20),
        )
    }

    /// Starts the broker's process again on the same port and storage, and
    /// waits until it takes connections.
    pub fn start_broker(&self) -> Result<(), Error> {
        let mut watchdog = self.watchdog.lock().unwrap_or_else(PoisonError::into_inner);
        watchdog.say("start")?;
        await_accepting(self.port, &self.dir, &mut watchdog)
    }

    /// A broker shared by every test of this binary, started on first use.
    ///
    /// # Panics
    ///
    /// When it cannot start, saying why (and what to install).
    pub fn shared() -> &'static Self {
        static SHARED: OnceLock<TestKafka> = OnceLock::new();
        SHARED.get_or_init(|| {
            Self::start().unwrap_or_else(|error| panic!("cannot start tansu: {error}"))
        })
    }

    /// The bootstrap servers: `127.0.0.1:PORT`.
    pub fn servers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The broker's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A topic name no other case of this process uses.
    pub fn fresh_topic(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{}-{}",
            std::process::id(),
            TOPICS.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// The broker's log so far (its last lines).
    pub fn log(&self) -> String {
        process::tail(&self.dir.join("tansu.log"), 50)
    }

    /// Stops the broker now.
    pub fn stop(&self) {
        self.watchdog
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .finish();
    }
}

/// Waits until the broker on `port` takes connections.
fn await_accepting(port: u16, dir: &std::path::Path, watchdog: &mut Watchdog) -> Result<(), Error> {
    let log = dir.join("tansu.log");
    process::await_ready(
        &format!("tansu on port {port} takes connections"),
        || {
            TcpStream::connect_timeout(
                &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                Duration::from_millis(200),
            )
            .map(drop)
            .map_err(|error| error.to_string())
        },
        || {
            watchdog
                .has_ended()
                .then(|| "its watchdog ended".to_owned())
        },
        || process::tail(&log, 20),
    )
}

impl Drop for TestKafka {
    fn drop(&mut self) {
        self.stop();
    }
}
