//! The load generator: closed-loop HTTP/1.1 clients over 127.0.0.1.
//!
//! Each client holds one keep-alive connection and sends its next request as
//! soon as the previous answer is read whole, so the concurrency is exactly the
//! number of clients. Requests are written from a template and answers are read
//! with a minimal parser (status line, `Content-Length`, `Idempotent-Replayed`):
//! the generator does far less work per request than the servers it loads, and
//! it checks every answer, so a row never counts errors as throughput.
//!
//! The clients share one thread (a current-thread runtime); `cargo xtask bench`
//! pins this process to one CPU when it pins the server to the other. It prints
//! one JSON object: right answers per second, p50 and p99, errors.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Barrier;

use crate::BoxError;

/// One load run, from the command line.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Plan {
    /// The server, `HOST:PORT`.
    #[arg(long)]
    addr: SocketAddr,
    /// The request path; `{w}` is replaced by the client's number.
    #[arg(long)]
    path: String,
    /// Extra header lines (`Name: value`), repeatable. `{session}` in one is
    /// replaced, request by request, by a session id derived from the request's
    /// key (see [`session_id`]).
    #[arg(long = "header")]
    headers: Vec<String>,
    /// The request body.
    #[arg(long)]
    body: String,
    /// A new key for every request: `{prefix}-` and 16 random hex digits, so
    /// that keys land all over an index, as clients' UUIDs do.
    #[arg(long, conflicts_with = "replay_keys")]
    fresh_keys: Option<String>,
    /// Keys `{prefix}0` to `{prefix}{pool - 1}`, each client cycling over its
    /// share; every key is sent once before the run starts, so that every
    /// measured request is a replay.
    #[arg(long)]
    replay_keys: Option<String>,
    /// The replay keys' pool.
    #[arg(long, default_value_t = 1_000)]
    pool: usize,
    /// Clients, each with one connection.
    #[arg(long)]
    concurrency: usize,
    /// Answers before this (ms) are not measured.
    #[arg(long, default_value_t = 1_000)]
    warmup_ms: u64,
    /// The measured window (ms), unless stopped earlier.
    #[arg(long)]
    duration_ms: u64,
    /// What a right answer is.
    #[arg(long, value_enum)]
    expect: Expect,
    /// End the measured window when stdin closes.
    #[arg(long)]
    stop_on_eof: bool,
}

/// Which `Idempotency-Key` each request carries.
#[derive(Clone, Debug)]
enum Keys {
    /// No key header.
    None,
    Fresh(String),
    Replay {
        prefix: String,
        pool: usize,
    },
}

impl Plan {
    fn keys(&self) -> Keys {
        match (&self.fresh_keys, &self.replay_keys) {
            (Some(prefix), _) => Keys::Fresh(prefix.clone()),
            (None, Some(prefix)) => Keys::Replay {
                prefix: prefix.clone(),
                pool: self.pool,
            },
            (None, None) => Keys::None,
        }
    }
}

/// What a right answer looks like.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Expect {
    /// `201` from the handler (not a replay).
    Executed,
    /// `201` replayed (`Idempotent-Replayed: true`).
    Replayed,
    /// Any `2xx`, replayed or not (a storm mixes both).
    Success,
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub(crate) struct Measured {
    /// Right answers in the measured window.
    pub(crate) requests: u64,
    /// Every answer, warm-up and priming included.
    pub(crate) answered: u64,
    /// The measured window, in seconds.
    pub(crate) seconds: f64,
    /// Latencies of the right answers, in microseconds, sorted.
    pub(crate) latencies: Vec<u32>,
    /// Wrong answers and failed requests, in the measured window.
    pub(crate) errors: u64,
    /// The first of them, for the report.
    pub(crate) first_error: Option<String>,
}

impl Measured {
    /// Right answers per second.
    pub(crate) fn rps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.requests as f64 / self.seconds
        } else {
            0.0
        }
    }

    /// The latency at quantile `q` (0 to 1), in milliseconds.
    pub(crate) fn quantile_ms(&self, q: f64) -> f64 {
        quantile_ms(&self.latencies, q)
    }
}

/// The value at quantile `q` of sorted microseconds, in milliseconds.
pub(crate) fn quantile_ms(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    f64::from(sorted[rank - 1]) / 1000.0
}

/// Runs `plan` and prints what it measured as one JSON object.
pub(crate) fn run(plan: Plan) -> Result<(), BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    if plan.stop_on_eof {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            stop.store(true, Ordering::Relaxed);
        });
    }
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let measured = runtime.block_on(drive(Arc::new(plan), stop))?;
    let answer = serde_json::json!({
        "requests": measured.requests,
        "seconds": measured.seconds,
        "per_second": measured.rps(),
        "p50_ms": measured.quantile_ms(0.5),
        "p99_ms": measured.quantile_ms(0.99),
        "errors": measured.errors,
        "answered": measured.answered,
        "cpu_seconds": cpu_seconds(),
        "wall_seconds": started.elapsed().as_secs_f64(),
        "first_error": measured.first_error,
    });
    println!("{answer}");
    Ok(())
}

async fn drive(plan: Arc<Plan>, stop: Arc<AtomicBool>) -> Result<Measured, String> {
    let barrier = Arc::new(Barrier::new(plan.concurrency));
    let start = Arc::new(OnceLock::new());
    let mut clients = Vec::with_capacity(plan.concurrency);
    for client in 0..plan.concurrency {
        clients.push(tokio::spawn(client_loop(
            client,
            Arc::clone(&plan),
            Arc::clone(&barrier),
            Arc::clone(&start),
            Arc::clone(&stop),
        )));
    }
    let mut measured = Measured::default();
    let mut window_end = None::<Instant>;
    for client in clients {
        let done = client
            .await
            .map_err(|e| format!("a load client failed: {e}"))??;
        measured.requests += done.requests;
        measured.answered += done.answered;
        measured.errors += done.errors;
        measured.latencies.extend(done.latencies);
        if measured.first_error.is_none() {
            measured.first_error = done.first_error;
        }
        window_end = window_end.max(Some(done.ended));
    }
    let measured_from = start
        .get()
        .map(|start: &Instant| *start + Duration::from_millis(plan.warmup_ms))
        .ok_or("the run never started")?;
    measured.seconds = window_end
        .map(|end| end.saturating_duration_since(measured_from).as_secs_f64())
        .unwrap_or_default();
    measured.latencies.sort_unstable();
    Ok(measured)
}

/// What one client measured.
struct ClientDone {
    /// Every answer, measured or not (warm-up and priming included).
    answered: u64,
    requests: u64,
    errors: u64,
    latencies: Vec<u32>,
    first_error: Option<String>,
    ended: Instant,
}

async fn client_loop(
    client: usize,
    plan: Arc<Plan>,
    barrier: Arc<Barrier>,
    start: Arc<OnceLock<Instant>>,
    stop: Arc<AtomicBool>,
) -> Result<ClientDone, String> {
    let mut connection = Connection::open(plan.addr).await?;
    let path = plan.path.replace("{w}", &client.to_string());
    let mut request = Vec::with_capacity(512 + plan.body.len());
    // Replay keys: this client's share of the pool, each sent once first.
    let keys = plan.keys();
    let own_keys: Vec<String> = match &keys {
        Keys::Replay { prefix, pool } => (client..*pool)
            .step_by(plan.concurrency)
            .map(|i| format!("{prefix}{i}"))
            .collect(),
        _ => Vec::new(),
    };
    for key in &own_keys {
        write_request(&mut request, &plan, &path, Some(key));
        let answer = connection.exchange(&request).await?;
        if !(200..300).contains(&answer.status) {
            return Err(format!(
                "priming replay key {key}: status {}",
                answer.status
            ));
        }
    }
    barrier.wait().await;
    let started = *start.get_or_init(Instant::now);
    let measured_from = started + Duration::from_millis(plan.warmup_ms);
    let end = measured_from + Duration::from_millis(plan.duration_ms);
    let mut done = ClientDone {
        answered: own_keys.len() as u64,
        requests: 0,
        errors: 0,
        latencies: Vec::with_capacity(1 << 14),
        first_error: None,
        ended: end,
    };
    let mut sequence = 0u64;
    let mut fresh_key = String::new();
    let mut random = XorShift::seeded(client);
    let mut late_verdict = None;
    loop {
        let now = Instant::now();
        if now >= end || stop.load(Ordering::Relaxed) {
            done.ended = late_verdict.unwrap_or(now.min(end));
            break;
        }
        let key = match &keys {
            Keys::None => None,
            Keys::Fresh(prefix) => {
                sequence += 1;
                fresh_key.clear();
                use std::fmt::Write;
                let _ = write!(fresh_key, "{prefix}-{:016x}", random.next());
                Some(fresh_key.as_str())
            }
            Keys::Replay { .. } => {
                let index = (sequence as usize) % own_keys.len().max(1);
                sequence += 1;
                own_keys.get(index).map(String::as_str)
            }
        };
        write_request(&mut request, &plan, &path, key);
        let sent = Instant::now();
        let outcome = connection.exchange(&request).await;
        let answered = Instant::now();
        // A client's first verdict, when it lands past the window (a route
        // slower than the window, a starved machine), is measured, and the
        // window ends with it, rather than the run answering nothing.
        let late = answered > end && done.requests + done.errors == 0;
        let measured = answered >= measured_from && (answered <= end || late);
        if late {
            late_verdict = Some(answered);
        }
        if outcome.is_ok() {
            done.answered += 1;
        }
        let verdict = match outcome {
            Ok(answer) => check(plan.expect, &answer),
            Err(error) => {
                // The connection is gone: open another and go on.
                if let Ok(fresh) = Connection::open(plan.addr).await {
                    connection = fresh;
                }
                Err(error)
            }
        };
        if !measured {
            continue;
        }
        match verdict {
            Ok(()) => {
                done.requests += 1;
                let micros = answered.duration_since(sent).as_micros();
                done.latencies
                    .push(u32::try_from(micros).unwrap_or(u32::MAX));
            }
            Err(error) => {
                done.errors += 1;
                done.first_error.get_or_insert(error);
            }
        }
    }
    Ok(done)
}

/// xorshift64*: random enough to spread keys, and free of system calls.
struct XorShift(u64);

impl XorShift {
    /// A generator for `client`, different in every run.
    fn seeded(client: usize) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos() as u64);
        let seed = nanos ^ (client as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Self(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// The CPU time (user + system) this process has used, in seconds.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the command name (which may hold spaces): utime and stime are the
    // 12th and 13th fields, in clock ticks (100 per second on Linux).
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ').skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

fn check(expect: Expect, answer: &Answer) -> Result<(), String> {
    let ok = match expect {
        Expect::Executed => answer.status == 201 && !answer.replayed,
        Expect::Replayed => answer.status == 201 && answer.replayed,
        Expect::Success => (200..300).contains(&answer.status),
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "expected {expect:?}, got status {}{}",
            answer.status,
            if answer.replayed { " (replayed)" } else { "" }
        ))
    }
}

fn write_request(out: &mut Vec<u8>, plan: &Plan, path: &str, key: Option<&str>) {
    use std::io::Write;
    out.clear();
    let _ = write!(
        out,
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        plan.addr,
        plan.body.len(),
    );
    for header in &plan.headers {
        match (header.split_once("{session}"), key) {
            (Some((before, after)), Some(key)) => {
                let _ = write!(out, "{before}{}{after}\r\n", session_id(key));
            }
            _ => {
                let _ = write!(out, "{header}\r\n");
            }
        }
    }
    if let Some(key) = key {
        let _ = write!(out, "Idempotency-Key: {key}\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(plan.body.as_bytes());
}

/// A session id for `key`: 22 base64url characters (the form of a ruts session
/// id), the same for every request with that key. A peer that keeps records in
/// the caller's session (axum-idempotent) so sees one session per key, as if
/// every key came from a user of its own, and its duplicates share a session.
fn session_id(key: &str) -> String {
    use std::hash::{Hash, Hasher};
    let hash = |salt: u8| {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        salt.hash(&mut hasher);
        key.hash(&mut hasher);
        hasher.finish()
    };
    // 21 hex digits and a final `A`: valid base64url, whose last character
    // carries no bits past the 128 an id encodes.
    format!("{:016x}{:05x}A", hash(0), hash(1) & 0xf_ffff)
}

/// An answer, as far as the generator reads it.
struct Answer {
    status: u16,
    replayed: bool,
}

/// A keep-alive connection and what was read past the last answer.
struct Connection {
    stream: TcpStream,
    buffer: Vec<u8>,
}

impl Connection {
    async fn open(addr: SocketAddr) -> Result<Self, String> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("nodelay: {e}"))?;
        Ok(Self {
            stream,
            buffer: Vec::with_capacity(8192),
        })
    }

    /// Sends `request` and reads its answer whole.
    async fn exchange(&mut self, request: &[u8]) -> Result<Answer, String> {
        self.stream
            .write_all(request)
            .await
            .map_err(|e| format!("write: {e}"))?;
        loop {
            if let Some(head_end) = find(&self.buffer, b"\r\n\r\n") {
                let (status, length, replayed) = parse_head(&self.buffer[..head_end])?;
                let total = head_end + 4 + length;
                while self.buffer.len() < total {
                    self.fill().await?;
                }
                self.buffer.drain(..total);
                return Ok(Answer { status, replayed });
            }
            self.fill().await?;
        }
    }

    async fn fill(&mut self) -> Result<(), String> {
        self.buffer.reserve(4096);
        let read = self
            .stream
            .read_buf(&mut self.buffer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        if read == 0 {
            return Err("the server closed the connection".to_owned());
        }
        Ok(())
    }
}

/// The status, `Content-Length` and whether `Idempotent-Replayed` is there.
fn parse_head(head: &[u8]) -> Result<(u16, usize, bool), String> {
    let text = std::str::from_utf8(head).map_err(|_| "a non-UTF-8 answer head".to_owned())?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let mut length = None;
    let mut replayed = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = value.trim().parse().ok();
        } else if name.eq_ignore_ascii_case("idempotent-replayed")
            || name.eq_ignore_ascii_case("idempotency-replayed")
        {
            // idem's marker, and the one the peers use (`cargo xtask bench`).
            replayed = value.trim() == "true";
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err("a chunked answer (the generator reads sized ones only)".to_owned());
        }
    }
    let length = length.ok_or("an answer without Content-Length")?;
    Ok((status, length, replayed))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_parsed_case_insensitively() {
        let head = b"HTTP/1.1 201 Created\r\ncontent-length: 12\r\nIdempotent-Replayed: true";
        assert_eq!(parse_head(head), Ok((201, 12, true)));
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nx: y").is_err());
        let peer = b"HTTP/1.1 201 Created\r\nidempotency-replayed: true\r\ncontent-length: 3";
        assert_eq!(parse_head(peer), Ok((201, 3, true)));
    }

    #[test]
    fn session_ids_are_ruts_shaped_and_follow_the_key() {
        let id = session_id("k-1");
        assert_eq!(id.len(), 22);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'A'));
        assert!(id.ends_with('A'));
        assert_eq!(id, session_id("k-1"));
        assert_ne!(id, session_id("k-2"));
    }

    /// A route slower than the whole window (an answer 400 ms after each
    /// request, a window of 50 ms) is measured by its first answer, the
    /// window ending with it, rather than reported as no right answer.
    #[tokio::test]
    async fn a_first_answer_past_the_window_is_measured() -> Result<(), String> {
        const SLOW: Duration = Duration::from_millis(400);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let mut request = Vec::new();
            let mut buffer = [0u8; 1024];
            loop {
                let Ok(read) = stream.read(&mut buffer).await else {
                    return;
                };
                if read == 0 {
                    return;
                }
                request.extend_from_slice(&buffer[..read]);
                if request.windows(4).any(|w| w == b"\r\n\r\n") {
                    request.clear();
                    tokio::time::sleep(SLOW).await;
                    let answer = b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n";
                    if stream.write_all(answer).await.is_err() {
                        return;
                    }
                }
            }
        });
        let plan = Plan {
            addr,
            path: "/slow".to_owned(),
            headers: Vec::new(),
            body: String::new(),
            fresh_keys: None,
            replay_keys: None,
            pool: 1,
            concurrency: 1,
            warmup_ms: 0,
            duration_ms: 50,
            expect: Expect::Executed,
            stop_on_eof: false,
        };
        let measured = drive(Arc::new(plan), Arc::new(AtomicBool::new(false))).await?;
        assert_eq!((measured.requests, measured.errors), (1, 0));
        assert!(
            measured.seconds >= SLOW.as_secs_f64(),
            "the window ends with the late answer: {} s",
            measured.seconds
        );
        Ok(())
    }

    #[test]
    fn quantiles_take_the_rank_above() {
        let sorted: Vec<u32> = (1..=100).map(|ms| ms * 1000).collect();
        assert!((quantile_ms(&sorted, 0.5) - 50.0).abs() < 1e-9);
        assert!((quantile_ms(&sorted, 0.99) - 99.0).abs() < 1e-9);
        assert!(quantile_ms(&[], 0.5).abs() < 1e-9);
    }
}
