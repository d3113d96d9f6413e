//! A throwaway SQS: moto's server (PyPI's `moto[server]`), on a free port of
//! 127.0.0.1.
//!
//! moto implements SQS's standard and FIFO queues in memory: visibility
//! timeouts, `ApproximateReceiveCount`, redrive policies, FIFO groups and
//! deduplication within 5 minutes. It runs on the Python that imports
//! moto (`python3`, else the one `moto_server` on `PATH` names), through a
//! launcher that makes each queue's message operations atomic. The
//! server is ready when it answers an SQS call (`ListQueues`) with `200 OK`.
//! It accepts any credentials; the region is the client's. A test binary
//! starts one and gives each case a queue of its own
//! ([`TestSqs::fresh_name`]).
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

/// moto's server, with each queue's receive, delete, visibility change and
/// purge made atomic under the queue's own lock, a received message's
/// retention read from its queue's one attribute, and no log line for each
/// request (a tenth of moto's time; errors are still logged).
///
/// moto serves each request on a thread of its own, and its delete rebuilds
/// the queue's message list without a lock: two deletes at once can put a
/// deleted message back, where it stays in flight for good (seen as one
/// message left after a drain of 200 with ten deletes at a time, and
/// reproduced with 2,000 messages and ten threads deleting). The lock is
/// the `Condition` moto's own send takes; a long-polling receive waits on
/// it, which releases it, so a send still wakes the receive at once.
///
/// moto checks each message a receive hands out against the queue's
/// retention period by computing every attribute of the queue, three of
/// them by walking all its messages (reading the clock for each): a
/// receive cost the square of the queue's depth, and with the e2e run's
/// SQS rows on one server, 40 % of moto's time went there (py-spy). The
/// check is the same, on the one attribute it reads.
const LAUNCHER: &str = r#"
import functools
import logging
import sys

from moto.sqs import models


def atomic(name):
    original = getattr(models.SQSBackend, name)

    @functools.wraps(original)
    def method(self, queue_name, *args, **kwargs):
        with self.get_queue(queue_name)._messages_lock:
            return original(self, queue_name, *args, **kwargs)

    setattr(models.SQSBackend, name, method)


for name in ("receive_message", "delete_message", "change_message_visibility", "purge_queue"):
    atomic(name)


def retained(self, queue_name, message):
    queue = self.get_queue(queue_name)
    return queue.message_retention_period + message.sent_timestamp / 1000 > models.unix_time()


models.SQSBackend.is_message_valid_based_on_retention_period = retained

# A line a request is a tenth of moto's time; errors are still logged.
logging.getLogger("werkzeug").setLevel(logging.WARNING)

from moto.server import main

sys.argv[0] = "moto_server"
main()
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
        process::attempts(START_ATTEMPTS, |_| true, || Self::start_once(&server))
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

/// The command that runs moto's server: [`LAUNCHER`] on `python3` when it
/// imports moto, else on the Python that `moto_server` on `PATH` runs (its
/// `#!` line).
fn server() -> Result<Vec<String>, Error> {
    let python = if imports_moto(&["python3".to_owned()]) {
        Some(vec!["python3".to_owned()])
    } else {
        // pyenv's shim is on PATH whether or not this Python has moto: ask
        // the interpreter the script names.
        process::find_in([], "moto_server")
            .and_then(|path| interpreter(&path))
            .filter(|python| imports_moto(python))
    };
    match python {
        Some(mut command) => {
            command.extend(["-c".to_owned(), LAUNCHER.to_owned()]);
            Ok(command)
        }
        None => Err(Error::NotInstalled {
            what: "moto's server (a Python that imports moto.server, flask and flask_cors)",
            searched: "python3 and the interpreter of moto_server on PATH".to_owned(),
            fix: FIX,
        }),
    }
}

/// Whether `python` (a program and its first arguments) imports moto's
/// server.
fn imports_moto(python: &[String]) -> bool {
    let Some((program, args)) = python.split_first() else {
        return false;
    };
    Command::new(program)
        .args(args)
        .args(["-c", "import moto.server, flask, flask_cors"])
        .output()
        .is_ok_and(|output| output.status.success())
}

/// The interpreter a script's `#!` line names, with its arguments.
fn interpreter(script: &std::path::Path) -> Option<Vec<String>> {
    let text = std::fs::read(script).ok()?;
    let first = text.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(first).ok()?.strip_prefix("#!")?;
    let words: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
    (!words.is_empty()).then_some(words)
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
