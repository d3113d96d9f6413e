//! A refused body is read within bounds (`docs/contract.md` §4): at most the
//! limit and 8 MiB of it before the `413`, and nothing after: the connection
//! closes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;

use crate::app::LIMITED_BYTES;
use crate::{RECEIVE_BUFFER, Target};

/// What §4 lets the server read and drop of a refused body.
const DRAIN_BYTES: u64 = 8 * 1024 * 1024;
/// The test client's send buffer (Linux doubles it).
const SEND_BUFFER: u32 = 64 * 1024;
/// What the two kernels hold between the client's writes and the app's reads:
/// the client's send buffer and the app's receive buffer, both fixed, each
/// doubled by Linux.
const KERNEL_BUFFERS: u64 = 2 * (SEND_BUFFER as u64 + RECEIVE_BUFFER as u64);
/// What the frameworks may have read from the socket beyond what the
/// middleware counted: hyper's read buffer (up to about 400 KiB, actix-web's
/// 32 KiB and 32 KiB in the payload), and the chunk the middleware's count
/// steps over the limit and the drain bound with.
const FRAMEWORK_BUFFERS: u64 = 1024 * 1024;
/// The body's piece per write.
const PIECE: usize = 64 * 1024;
/// A declared body far over the drain bound: the middleware refuses it
/// unread.
const DECLARED: u64 = 64 * 1024 * 1024;

/// A body far over the limit that keeps coming, chunked (no end) and declared
/// (64 MiB), from a client that writes on after the answer: the server reads
/// at most the limit and 8 MiB of it, answers `413 payload-too-large`, and
/// closes the connection rather than reading on.
///
/// The client counts what the server's side accepted: the bytes its writes
/// handed to its kernel, until a write fails because the server closed. That
/// is what the app read, plus what the kernels held, plus what the framework
/// read into its own buffers. The kernels' share is fixed: the client's send
/// buffer and the app's receive buffer ([`bind`](crate::bind)) hold 256 KiB
/// between them, and a plain server that reads exactly 8 MiB and 1 KiB and
/// then stops is seen to accept 243–255 KiB more. Left to Linux, that share
/// is not bounded by much: a fast reader's receive buffer grows, and the same
/// server was seen to accept 0.9–3.1 MiB more (up to `tcp_rmem`'s maximum,
/// 32 MiB, is possible), which is how "12 MiB before the 413" can be read
/// off a server that reads 8 MiB. So the bound is the limit, 8 MiB,
/// [`KERNEL_BUFFERS`] and [`FRAMEWORK_BUFFERS`]: about 9.25 MiB.
///
/// Before idem-actix closed such a connection, actix-web read on after its
/// `413`: the chunked body past 512 MiB (with no end, the connection kept
/// alive), the declared one whole (64 MiB) while it lingered; hyper closes.
pub(crate) async fn refused_body_is_read_within_its_bound_then_closed(target: Target) {
    let addr = target.base().trim_start_matches("http://").to_owned();
    let bound = LIMITED_BYTES as u64 + DRAIN_BYTES + KERNEL_BUFFERS + FRAMEWORK_BUFFERS;
    for framing in [Framing::Chunked, Framing::Declared(DECLARED)] {
        let Pushed {
            accepted_before_answer,
            accepted,
            closed,
            answer,
        } = push(&addr, framing, bound).await;
        let numbers = format!(
            "{framing:?}: accepted {accepted_before_answer:?} bytes before the answer, \
             {accepted} in all; bound {bound}"
        );
        // Shown with `--nocapture`: the figures behind the verdict.
        eprintln!("{numbers}");
        assert!(
            answer.starts_with("HTTP/1.1 413"),
            "{numbers}; the answer: {answer}"
        );
        assert!(
            answer.contains("https://idem.rs/problems/payload-too-large"),
            "{numbers}; the answer: {answer}"
        );
        assert!(
            closed,
            "{numbers}: the server read on past the bound instead of closing"
        );
        assert!(
            accepted_before_answer.is_some_and(|before| before <= bound),
            "{numbers}"
        );
    }
}

/// How a body says how long it is.
#[derive(Clone, Copy, Debug)]
enum Framing {
    /// `Transfer-Encoding: chunked`, with no last chunk.
    Chunked,
    /// `Content-Length`.
    Declared(u64),
}

/// What a server took of a body pushed at it.
struct Pushed {
    /// The bytes accepted when the answer's head arrived.
    accepted_before_answer: Option<u64>,
    /// The bytes accepted in all.
    accepted: u64,
    /// Whether the connection closed (a write failed) before `bound` bytes
    /// were accepted.
    closed: bool,
    /// The answer, as far as it arrived.
    answer: String,
}

/// Pushes a keyed POST to `/limited` at `addr` whose body does not end (or
/// is as long as it declares), writing on after the answer, until a write
/// fails or more than `bound` bytes of body are accepted.
async fn push(addr: &str, framing: Framing, bound: u64) -> Pushed {
    let connected = async {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_send_buffer_size(SEND_BUFFER)?;
        let addr = addr.parse().map_err(std::io::Error::other)?;
        socket.connect(addr).await
    };
    let stream = connected
        .await
        .unwrap_or_else(|error| panic!("cannot connect to {addr}: {error}"));
    let (read, mut write) = stream.into_split();
    let framing_header = match framing {
        Framing::Chunked => "Transfer-Encoding: chunked".to_owned(),
        Framing::Declared(length) => format!("Content-Length: {length}"),
    };
    let head = format!(
        "POST /limited HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: drain-1\r\n\
         Content-Type: application/octet-stream\r\n{framing_header}\r\n\r\n"
    );
    write
        .write_all(head.as_bytes())
        .await
        .unwrap_or_else(|error| panic!("cannot send the head: {error}"));
    let accepted = Arc::new(AtomicU64::new(0));
    let answer = tokio::spawn(read_answer(read, Arc::clone(&accepted)));
    let mut piece = Vec::with_capacity(PIECE + 16);
    if matches!(framing, Framing::Chunked) {
        piece.extend_from_slice(format!("{PIECE:x}\r\n").as_bytes());
    }
    piece.resize(piece.len() + PIECE, b'x');
    if matches!(framing, Framing::Chunked) {
        piece.extend_from_slice(b"\r\n");
    }
    let closed = loop {
        let sent = accepted.load(Ordering::SeqCst);
        if sent > bound || matches!(framing, Framing::Declared(length) if sent >= length) {
            break false;
        }
        // A server that neither reads nor closes would hold the write: a
        // failure, not a measurement.
        let written =
            tokio::time::timeout(std::time::Duration::from_secs(30), write.write_all(&piece)).await;
        match written {
            Ok(Ok(())) => {
                accepted.fetch_add(piece.len() as u64, Ordering::SeqCst);
            }
            Ok(Err(_)) => break true,
            Err(_) => panic!(
                "{framing:?}: the server stopped reading after {sent} bytes and kept the connection open"
            ),
        }
    };
    let accepted = accepted.load(Ordering::SeqCst);
    drop(write);
    let (answer, accepted_before_answer) =
        match tokio::time::timeout(std::time::Duration::from_secs(30), answer).await {
            Ok(Ok(read)) => read,
            Ok(Err(error)) => std::panic::resume_unwind(error.into_panic()),
            Err(_) => panic!("{framing:?}: the connection was still open 30 s after"),
        };
    Pushed {
        accepted_before_answer,
        accepted,
        closed,
        answer,
    }
}

/// Reads the answer until the connection ends; answers it, with the bytes
/// `accepted` when its head had arrived.
async fn read_answer(mut read: OwnedReadHalf, accepted: Arc<AtomicU64>) -> (String, Option<u64>) {
    let mut answer = Vec::new();
    let mut accepted_then = None;
    let mut buffer = [0u8; 4096];
    while let Ok(n @ 1..) = read.read(&mut buffer).await {
        answer.extend_from_slice(&buffer[..n]);
        if accepted_then.is_none() && answer.windows(4).any(|end| end == b"\r\n\r\n") {
            accepted_then = Some(accepted.load(Ordering::SeqCst));
        }
    }
    (String::from_utf8_lossy(&answer).into_owned(), accepted_then)
}
