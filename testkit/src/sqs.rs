//! A throwaway SQS: moto's server (PyPI's `moto[server]`), on a free port of
//! 127.0.0.1.
//!
//! moto implements SQS's standard and FIFO queues in memory: visibility
//! timeouts, `ApproximateReceiveCount`, redrive policies, FIFO groups and
//! deduplication within 5 minutes. It is `moto_server` when that is on
//! `PATH`, else `python3 -m moto.server`. The server is ready when it answers
//! an SQS call (`ListQueues`) with `200 OK`. It accepts any credentials; the
//! region is the client's. A test binary starts one and gives each case a
//! queue of its own ([`TestSqs::fresh_name`]).
//!
//! ```no_run
//! use idem_testkit::TestSqs;
//!
//! let sqs = TestSqs::start()?;
//! println!("{}", sqs.endpoint()); // http://127.0.0.1:PORT
//! # Ok::<(), idem_testkit::Error>(())
//! ```

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::Error;
use crate::process::{self, Watchdog};

/// How many times a start is tried on a fresh port.
const START_ATTEMPTS: usize = 3;

/// Runs the server (`$@`) until stdin closes, then stops it and deletes its
/// directory.
const WATCHDOG: &str = r#"
"$@" >"$IDEM_DIR/moto.log" 2>&1 &
pid=$!
read _ignored
kill $pid 2>/dev/null
wait $pid 2>/dev/null
rm -rf "$IDEM_DIR"
"#;

/// What to install when moto is missing.
const FIX: &str = "install moto's server from PyPI: pip install 'moto[server]'";

static NAMES: AtomicU64 = AtomicU64::new(0);

/// A moto server, stopped and deleted when dropped or when this process
/// ends.
pub struct TestSqs {
    port: u16,
    dir: PathBuf,
    watchdog: Watchdog,
}

impl TestSqs {
    /// Starts moto's server on a free port and waits until it answers.
    pub fn start() -> Result<Self, Error> {
        let server = server()?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once(&server) {
                Ok(sqs) => return Ok(sqs),
                Err(error) if attempt >= START_ATTEMPTS => return Err(error),
                Err(_) => continue,
            }
        }
    }

    fn start_once(server: &[String]) -> Result<Self, Error> {
        let [port] = process::free_ports(|_| true)?;
        let dir = crate::fresh_dir("sqs")?;
        let mut args: Vec<String> = server.to_vec();
        args.extend([
            "-H".to_owned(),
            "127.0.0.1".to_owned(),
            "-p".to_owned(),
            port.to_string(),
        ]);
        let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
        let watchdog = Watchdog::spawn(WATCHDOG, &args, |sh| {
            sh.env("IDEM_DIR", &dir);
        })?;
        let mut sqs = Self {
            port,
            dir,
            watchdog,
        };
        let log = sqs.dir.join("moto.log");
        let watchdog = &mut sqs.watchdog;
        process::await_ready(
            &format!("moto's server on port {port} answers ListQueues"),
            || list_queues(port),
            || watchdog.has_ended().then(|| "the server exited".to_owned()),
            || process::tail(&log, 40),
        )?;
        Ok(sqs)
    }

    /// One server shared by every test of this binary, started on first use.
    ///
    /// # Panics
    ///
    /// When it cannot start, saying why (and what to install).
    pub fn shared() -> &'static Self {
        static SHARED: OnceLock<TestSqs> = OnceLock::new();
        SHARED.get_or_init(|| {
            Self::start().unwrap_or_else(|error| panic!("cannot start moto's SQS server: {error}"))
        })
    }

    /// The endpoint URL a client is given: `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL moto gives a queue named `name` (its default account,
    /// 123456789012).
    pub fn queue_url(&self, name: &str) -> String {
        format!("{}/123456789012/{name}", self.endpoint())
    }

    /// A queue name no other test of this process has had, starting with
    /// `prefix` (add `.fifo` for a FIFO queue).
    pub fn fresh_name(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{}-{}",
            std::process::id(),
            NAMES.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// What the server printed.
    pub fn log(&self) -> String {
        process::tail(&self.dir.join("moto.log"), 200)
    }
}

impl std::fmt::Debug for TestSqs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestSqs")
            .field("port", &self.port)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// The command that runs moto's server: `moto_server`, else `python3 -m
/// moto.server` when python3 can import it.
fn server() -> Result<Vec<String>, Error> {
    if let Some(path) = process::find_in([], "moto_server") {
        // pyenv's shim is on PATH whether or not this Python has moto: ask it.
        let works = Command::new(&path)
            .arg("--help")
            .output()
            .is_ok_and(|output| output.status.success());
        if works {
            return Ok(vec![path.display().to_string()]);
        }
    }
    let imports = Command::new("python3")
        .args(["-c", "import moto.server, flask, flask_cors"])
        .output()
        .is_ok_and(|output| output.status.success());
    if imports {
        return Ok(vec![
            "python3".to_owned(),
            "-m".to_owned(),
            "moto.server".to_owned(),
        ]);
    }
    Err(Error::NotInstalled {
        what: "moto's server (moto_server, or python3 -m moto.server)",
        searched: "PATH and python3's modules".to_owned(),
        fix: FIX,
    })
}

/// `Ok` once the server on `port` answers `ListQueues` with `200 OK`.
fn list_queues(port: u16) -> Result<(), String> {
    let body = "Action=ListQueues&Version=2012-11-05";
    let request = format!(
        "POST / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/x-www-form-urlencoded\r\n\
         Authorization: AWS4-HMAC-SHA256 Credential=test/20240101/us-east-1/sqs/aws4_request, SignedHeaders=host, Signature=0\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(request.as_bytes())
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    if answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200") {
        Ok(())
    } else {
        Err(answer.lines().next().unwrap_or("no answer").to_owned())
    }
}
