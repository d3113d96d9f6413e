//! A throwaway Kafka-compatible broker: `tansu` (Apache-2.0, on crates.io),
//! a broker written in Rust, with its in-memory storage.
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

/// Once stdin closes: stops the broker and deletes its directory.
const WATCHDOG: &str = r#"
"$IDEM_TANSU_BIN" "$@" >"$IDEM_DIR/tansu.log" 2>&1 &
pid=$!
read _ignored
kill $pid 2>/dev/null
wait $pid 2>/dev/null
rm -rf "$IDEM_DIR"
"#;

static TOPICS: AtomicU64 = AtomicU64::new(0);

/// A `tansu` broker with in-memory storage, stopped when dropped or when this
/// process ends.
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
    cache_dir().join(format!("tansu-{TANSU_VERSION}"))
}

/// The `cargo install` arguments that build `tansu` into [`install_root`]:
/// pinned, with its lock file, with the in-memory storage engine, as a dev
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
        "dynostore",
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
              0.6.0 --features dynostore --root ~/.cache/idem/tansu-0.6.0`, about 8 minutes once), \
              or set IDEM_TANSU to a tansu binary",
    })
}

impl TestKafka {
    /// Starts a broker on a free port, and waits until it takes connections.
    pub fn start() -> Result<Self, Error> {
        let tansu = binary()?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let [port] = process::free_ports(|_| true)?;
            let dir = crate::fresh_dir("kafka")?;
            match Self::launch(&tansu, port, dir) {
                Ok(broker) => return Ok(broker),
                Err(error) if attempt >= START_ATTEMPTS => return Err(error),
                Err(_) => continue,
            }
        }
    }

    fn launch(tansu: &PathBuf, port: u16, dir: PathBuf) -> Result<Self, Error> {
        let url = format!("tcp://127.0.0.1:{port}");
        let args = [
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
            "--storage-engine",
            "memory://tansu/",
        ];
        let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
        let mut watchdog = Watchdog::spawn(WATCHDOG, &args, |sh| {
            sh.env("IDEM_TANSU_BIN", tansu).env("IDEM_DIR", &dir);
        })?;
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
        )?;
        Ok(Self {
            port,
            dir,
            watchdog: Mutex::new(watchdog),
        })
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

impl Drop for TestKafka {
    fn drop(&mut self) {
        self.stop();
    }
}
