//! A stand-in payment provider for the payments examples' tests and `cargo
//! xtask e2e`: an HTTP server on 127.0.0.1 that answers `POST /payments` after
//! a configurable delay with a configurable status, and counts the calls per
//! forwarded `Idempotency-Key`.
//!
//! A call counts when its request has arrived, before the delay: a client that
//! gives up waiting still made the call, as with a real provider.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use payments_provider::Provider;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> std::io::Result<()> {
//! let provider = Provider::start().await?;
//! provider.answer_after(Duration::from_millis(10));
//! assert!(provider.url().starts_with("http://127.0.0.1:"));
//! assert_eq!(provider.calls("charge-1"), 0);
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The longest request head or body the provider reads.
const MAX_REQUEST: usize = 64 * 1024;

/// A running provider; stops when dropped.
pub struct Provider {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    server: JoinHandle<()>,
}

/// One call the provider received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// The method and path, e.g. `POST /payments`.
    pub request_line: String,
    /// The `Idempotency-Key` header, if any.
    pub idempotency_key: Option<String>,
    /// The `Content-Type` header, if any.
    pub content_type: Option<String>,
    /// The body.
    pub body: Vec<u8>,
}

struct State {
    delay: Duration,
    status: u16,
    calls: Vec<Call>,
    /// When each of `calls` arrived.
    arrived: Vec<Instant>,
}

impl Provider {
    /// Starts a provider on a free port of 127.0.0.1 that answers `200` at once.
    pub async fn start() -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            delay: Duration::ZERO,
            status: 200,
            calls: Vec::new(),
            arrived: Vec::new(),
        }));
        let server = tokio::spawn(serve(listener, Arc::clone(&state)));
        Ok(Self {
            addr,
            state,
            server,
        })
    }

    /// The base URL, `http://127.0.0.1:PORT` (charges go to `{url}/payments`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answers each later call after `delay`.
    pub fn answer_after(&self, delay: Duration) {
        self.state().delay = delay;
    }

    /// Answers each later call with `status`.
    pub fn answer_with(&self, status: u16) {
        self.state().status = status;
    }

    /// How many calls carried `idempotency_key`.
    pub fn calls(&self, idempotency_key: &str) -> usize {
        self.state()
            .calls
            .iter()
            .filter(|call| call.idempotency_key.as_deref() == Some(idempotency_key))
            .count()
    }

    /// How many calls each `Idempotency-Key` made (`""` for calls without one).
    pub fn calls_per_key(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for call in &self.state().calls {
            let key = call.idempotency_key.clone().unwrap_or_default();
            *counts.entry(key).or_insert(0) += 1;
        }
        counts
    }

    /// Every call so far, in arrival order.
    pub fn received(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    /// When each call so far arrived (its request read whole), with its
    /// `Idempotency-Key` (`""` for a call without one), in arrival order.
    pub fn arrivals(&self) -> Vec<(Instant, String)> {
        let state = self.state();
        let keys = state
            .calls
            .iter()
            .map(|call| call.idempotency_key.clone().unwrap_or_default());
        state.arrived.iter().copied().zip(keys).collect()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn serve(listener: TcpListener, state: Arc<Mutex<State>>) {
    while let Ok((stream, _)) = listener.accept().await {
        tokio::spawn(answer(stream, Arc::clone(&state)));
    }
}

/// Reads one request, counts it, waits, answers, and closes the connection.
async fn answer(stream: TcpStream, state: Arc<Mutex<State>>) {
    let mut stream = BufReader::new(stream);
    let Ok(call) = read_call(&mut stream).await else {
        return;
    };
    let (delay, status) = {
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        state.calls.push(call);
        state.arrived.push(Instant::now());
        (state.delay, state.status)
    };
    tokio::time::sleep(delay).await;
    let body = format!("{{\"status\":{status}}}");
    let head = format!(
        "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        if (200..300).contains(&status) {
            "OK"
        } else {
            "Failed"
        },
        body.len()
    );
    let stream = stream.get_mut();
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.shutdown().await;
}

async fn read_call(stream: &mut BufReader<TcpStream>) -> io::Result<Call> {
    let too_large = || io::Error::new(io::ErrorKind::InvalidData, "request too large");
    let mut request_line = String::new();
    stream.read_line(&mut request_line).await?;
    let request_line = request_line.trim_end().to_owned();
    let (mut idempotency_key, mut content_type, mut length) = (None, None, 0);
    let mut read = request_line.len();
    loop {
        let mut line = String::new();
        if stream.read_line(&mut line).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        read += line.len();
        if read > MAX_REQUEST {
            return Err(too_large());
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim().to_owned();
        match name.trim().to_ascii_lowercase().as_str() {
            "idempotency-key" => idempotency_key = Some(value),
            "content-type" => content_type = Some(value),
            "content-length" => length = value.parse().map_err(|_| too_large())?,
            _ => {}
        }
    }
    if length > MAX_REQUEST {
        return Err(too_large());
    }
    let mut body = vec![0; length];
    stream.read_exact(&mut body).await?;
    Ok(Call {
        request_line: request_line
            .rsplit_once(' ')
            .map_or(request_line.clone(), |(line, _version)| line.to_owned()),
        idempotency_key,
        content_type,
        body,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[tokio::test]
    async fn counts_calls_per_key_and_answers_as_told() {
        let provider = Provider::start().await.unwrap();
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let post = |key: &'static str| {
            client
                .post(format!("{}/payments", provider.url()))
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(r#"{"amount":1}"#)
                .send()
        };
        assert_eq!(post("a").await.unwrap().status(), 200);
        provider.answer_with(503);
        assert_eq!(post("a").await.unwrap().status(), 503);
        assert_eq!(post("b").await.unwrap().status(), 503);
        assert_eq!((provider.calls("a"), provider.calls("b")), (2, 1));
        assert_eq!(
            provider.received()[0],
            Call {
                request_line: "POST /payments".into(),
                idempotency_key: Some("a".into()),
                content_type: Some("application/json".into()),
                body: br#"{"amount":1}"#.to_vec(),
            }
        );
    }

    #[tokio::test]
    async fn a_call_counts_before_its_delay() {
        let provider = Provider::start().await.unwrap();
        provider.answer_after(Duration::from_secs(30));
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_millis(300))
            .build()
            .unwrap();
        let sent = client
            .post(format!("{}/payments", provider.url()))
            .header("idempotency-key", "slow")
            .send()
            .await;
        assert!(sent.unwrap_err().is_timeout());
        assert_eq!(provider.calls("slow"), 1);
    }
}
