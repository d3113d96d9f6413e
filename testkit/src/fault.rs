//! A fault-injecting TCP proxy, put between a client and a server in a test:
//! it passes bytes both ways until told to hold them, drop them or cut the
//! connections, and, for PostgreSQL, to lose a COMMIT or its answer.
//!
//! [`Proxy::tcp`] forwards any protocol (PostgreSQL, HTTP to moto, AMQP,
//! Kafka…). [`Proxy::postgres`] also follows PostgreSQL's wire protocol,
//! message by message and in both directions, on every connection from its
//! first byte, so that it can lose a COMMIT ([`Fault::LoseCommits`]) or the
//! answer to one ([`Fault::LoseCommitAnswers`]) whenever that fault is set.
//! [`Proxy::set`] changes the fault at any time: the new one applies to the
//! bytes read from then on, on the open connections and on new ones.
//!
//! The proxy listens on a free port of 127.0.0.1 and opens one connection to
//! the target for each connection it accepts; a thread per direction copies
//! the bytes, with blocking `std::net` IO. Dropping the proxy stops accepting,
//! closes every connection, and waits until its threads have ended.
//!
//! ```no_run
//! use idem_testkit::TestPostgres;
//! use idem_testkit::fault::{Fault, Proxy};
//!
//! let cluster = TestPostgres::shared()?;
//! let database = cluster.fresh_database("doubt")?;
//! let proxy = Proxy::postgres(([127, 0, 0, 1], cluster.port()).into())?;
//! proxy.set(Fault::LoseCommitAnswers { every: 1 });
//! // A client of postgres://postgres@127.0.0.1:{proxy.port()}/{database}
//! // now commits, and sees its connection closed instead of the answer.
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// How many bytes a direction reads at a time.
const CHUNK: usize = 16 * 1024;

/// How much of a client message's body the PostgreSQL reader keeps: the
/// names and SQL text it looks at come first, and a COMMIT is short.
const KEPT: usize = 64 * 1024;

/// How long the connection to the target may take.
const CONNECT_LIMIT: Duration = Duration::from_secs(10);

/// The code of an `SSLRequest`, in place of a protocol version.
const SSL_REQUEST: u32 = 80_877_103;

/// The code of a `GSSENCRequest`.
const GSSENC_REQUEST: u32 = 80_877_104;

/// The code of a `CancelRequest`.
const CANCEL_REQUEST: u32 = 80_877_102;

/// What the proxy does to the traffic: one fault at a time, set with
/// [`Proxy::set`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    /// Passes every byte.
    #[default]
    None,
    /// PostgreSQL only: every `every`-th COMMIT (1: each one) reaches the
    /// server and commits, and its answer never reaches the client. The
    /// proxy watches the server's messages for a `CommandComplete` whose tag
    /// is exactly `COMMIT` (whichever protocol, simple or extended, sent the
    /// COMMIT); it forwards what came before that message, then closes both
    /// sides of the connection (`shutdown(Both)`: the client reads the end
    /// of the stream, not a TCP reset). A COMMIT of a failed transaction is
    /// answered `ROLLBACK`, and is not counted. Counted in
    /// [`Proxy::lost_commit_answers`].
    LoseCommitAnswers {
        /// Which COMMITs lose their answer: the `every`-th, `2 × every`-th…
        /// counted across all connections from the moment the fault is set.
        every: u32,
    },
    /// PostgreSQL only: every `every`-th COMMIT (1: each one) never reaches
    /// the server, which rolls the transaction back: the proxy forwards what
    /// came before the message that would commit, then closes both sides of
    /// the connection. That message is a simple `Query` whose last statement
    /// is `COMMIT` or `END` (optionally followed by `WORK` or `TRANSACTION`
    /// and `;`, in any case), or an `Execute` of a portal bound to a
    /// statement prepared from such a text. A query of several statements
    /// is lost whole; they are split at every `;`, quoted or not (a test's
    /// SQL is plain). Counted in [`Proxy::lost_commits`].
    LoseCommits {
        /// Which COMMITs are lost: the `every`-th, `2 × every`-th… counted
        /// across all connections from the moment the fault is set.
        every: u32,
    },
    /// Holds every byte, both ways, until the fault changes: nothing is
    /// read from a socket any more, and what was read is not forwarded yet.
    /// New connections are accepted and held the same way. The traffic goes
    /// on from where it was, nothing lost, once another fault is set.
    Stall,
    /// Closes every open connection at once, and each new one as soon as it
    /// is accepted, while set.
    Reset,
    /// Reads and drops every byte, both ways, while set: the connections stay
    /// open, new ones are accepted, and nothing is ever forwarded or
    /// answered. A client sees its timeouts. The bytes dropped are lost: a
    /// connection that carried some is broken for its protocol after.
    Blackhole,
    /// Any protocol: the client's bytes reach the server, and the server's
    /// never reach the client: the connection is closed, both sides, as
    /// soon as the server sends anything, while set. An HTTP server has
    /// done the request's work, and its client sees the connection end
    /// without an answer: the lost answer a retry with the same key mends.
    LoseAnswers,
    /// Any protocol: each chunk read, either way, is held this long before
    /// it is forwarded, as over a link with that much latency each way (a
    /// request and its answer take twice as long). A chunk that comes while
    /// one is held waits behind it: meant for traffic that waits for its
    /// answers, such as HTTP requests one at a time on a connection.
    Latency(Duration),
}

/// A TCP proxy on 127.0.0.1 to one target, injecting the [`Fault`] set.
///
/// Dropping it stops accepting, closes every connection, and waits until
/// its threads have ended.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accepter: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Starts a proxy to `target` that forwards any protocol, without
    /// reading it: [`set`](Self::set) refuses the PostgreSQL faults
    /// ([`Fault::LoseCommits`], [`Fault::LoseCommitAnswers`]).
    pub fn tcp(target: SocketAddr) -> io::Result<Self> {
        Self::start(target, false)
    }

    /// Starts a proxy to `target`, a PostgreSQL server, that follows the
    /// protocol's messages on every connection, so that every fault can be
    /// set at any time. After an encryption request that the server accepts
    /// (TLS or GSSAPI), the connection's bytes are passed as they are and no
    /// COMMIT is seen on it.
    pub fn postgres(target: SocketAddr) -> io::Result<Self> {
        Self::start(target, true)
    }

    fn start(target: SocketAddr, postgres: bool) -> io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            target,
            postgres,
            state: Mutex::new(State {
                fault: Fault::None,
                commits: 0,
                stopped: false,
                links: Vec::new(),
                threads: Vec::new(),
            }),
            changed: Condvar::new(),
            connections: AtomicU64::new(0),
            lost_commits: AtomicU64::new(0),
            lost_commit_answers: AtomicU64::new(0),
            lost_answers: AtomicU64::new(0),
        });
        let accepter = thread::Builder::new()
            .name("idem-proxy-accept".to_owned())
            .spawn({
                let shared = Arc::clone(&shared);
                move || accept(&shared, &listener)
            })?;
        Ok(Self {
            addr,
            shared,
            accepter: Some(accepter),
        })
    }

    /// Where clients connect: 127.0.0.1 and [`port`](Self::port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Where the proxy forwards to.
    pub fn target(&self) -> SocketAddr {
        self.shared.target
    }

    /// Sets the fault, for the bytes read from now on, on the open
    /// connections and new ones; it wakes the connections a [`Fault::Stall`]
    /// held. Setting a fault starts its COMMIT count again (see `every`).
    ///
    /// # Panics
    ///
    /// If `fault` is a PostgreSQL fault and the proxy was started with
    /// [`tcp`](Self::tcp), or its `every` is 0.
    #[track_caller]
    pub fn set(&self, fault: Fault) {
        if let Fault::LoseCommits { every } | Fault::LoseCommitAnswers { every } = fault {
            assert!(
                self.shared.postgres,
                "{fault:?} needs a proxy that reads PostgreSQL's protocol: start it with \
                 Proxy::postgres, not Proxy::tcp"
            );
            assert!(
                every > 0,
                "{fault:?}: `every` counts from 1 (1 is each COMMIT)"
            );
        }
        let mut state = self.shared.lock();
        state.fault = fault;
        state.commits = 0;
        if fault == Fault::Reset {
            for link in state.links.drain(..).filter_map(|link| link.upgrade()) {
                link.close();
            }
        }
        drop(state);
        self.shared.changed.notify_all();
    }

    /// The fault set now.
    pub fn fault(&self) -> Fault {
        self.shared.lock().fault
    }

    /// How many connections the proxy has accepted, those a
    /// [`Fault::Reset`] closed at once included.
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// How many COMMITs [`Fault::LoseCommits`] has kept from the server.
    pub fn lost_commits(&self) -> u64 {
        self.shared.lost_commits.load(Ordering::SeqCst)
    }

    /// How many COMMIT answers [`Fault::LoseCommitAnswers`] has kept from
    /// clients.
    pub fn lost_commit_answers(&self) -> u64 {
        self.shared.lost_commit_answers.load(Ordering::SeqCst)
    }

    /// How many connections [`Fault::LoseAnswers`] has closed on an answer,
    /// its bytes kept from the client.
    pub fn lost_answers(&self) -> u64 {
        self.shared.lost_answers.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let threads = {
            let mut state = self.shared.lock();
            // From here on no connection is registered and no thread started.
            state.stopped = true;
            for link in state.links.drain(..).filter_map(|link| link.upgrade()) {
                link.close();
            }
            std::mem::take(&mut state.threads)
        };
        self.shared.changed.notify_all();
        if let Some(accepter) = self.accepter.take() {
            // The accepting thread waits in `accept`: a connection wakes it,
            // and it sees `stopped`. Without one, it is left waiting rather
            // than waited for.
            if TcpStream::connect_timeout(&self.addr, Duration::from_secs(5)).is_ok() {
                let _ = accepter.join();
            }
        }
        // Every socket is shut down: reads end, writes fail, and the threads
        // a stall held are woken.
        for thread in threads {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("target", &self.shared.target)
            .field("postgres", &self.shared.postgres)
            .field("fault", &self.fault())
            .finish_non_exhaustive()
    }
}

/// What the proxy's threads share.
struct Shared {
    target: SocketAddr,
    /// Whether connections are read as PostgreSQL's protocol.
    postgres: bool,
    state: Mutex<State>,
    /// Notified when the fault changes, or the proxy stops.
    changed: Condvar,
    connections: AtomicU64,
    lost_commits: AtomicU64,
    lost_commit_answers: AtomicU64,
    lost_answers: AtomicU64,
}

struct State {
    fault: Fault,
    /// COMMITs counted since the fault was set.
    commits: u64,
    /// The proxy is dropped: nothing new starts.
    stopped: bool,
    /// The connections, possibly ended (their directions hold them).
    links: Vec<Weak<Link>>,
    /// The threads started, possibly ended: joined when the proxy is dropped.
    threads: Vec<JoinHandle<()>>,
}

impl State {
    fn keep(&mut self, thread: JoinHandle<()>) {
        self.threads.retain(|thread| !thread.is_finished());
        self.threads.push(thread);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits while the fault is [`Fault::Stall`], and answers the fault
    /// then; `None` once the proxy is dropped.
    fn unstalled(&self) -> Option<Fault> {
        let state = self
            .changed
            .wait_while(self.lock(), |state| {
                state.fault == Fault::Stall && !state.stopped
            })
            .unwrap_or_else(PoisonError::into_inner);
        (!state.stopped).then_some(state.fault)
    }

    /// Counts a COMMIT seen going `side`, and answers whether the fault set
    /// loses it.
    fn loses(&self, side: Side) -> bool {
        let mut state = self.lock();
        let (every, lost) = match (side, state.fault) {
            (Side::Up, Fault::LoseCommits { every }) => (every, &self.lost_commits),
            (Side::Down, Fault::LoseCommitAnswers { every }) => (every, &self.lost_commit_answers),
            _ => return false,
        };
        state.commits += 1;
        let loses = state.commits.is_multiple_of(u64::from(every));
        if loses {
            lost.fetch_add(1, Ordering::SeqCst);
        }
        loses
    }
}

/// Accepts connections until the proxy is dropped.
fn accept(shared: &Arc<Shared>, listener: &TcpListener) {
    loop {
        let accepted = listener.accept();
        let mut state = shared.lock();
        if state.stopped {
            return;
        }
        let client = match accepted {
            Ok((client, _)) => client,
            Err(_) => {
                // Out of descriptors, say: try again a little later.
                drop(state);
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        shared.connections.fetch_add(1, Ordering::SeqCst);
        if state.fault == Fault::Reset {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let started = thread::Builder::new()
            .name("idem-proxy-up".to_owned())
            .spawn({
                let shared = Arc::clone(shared);
                move || serve(&shared, client)
            });
        // A thread that cannot start drops the client: its connection closes.
        if let Ok(thread) = started {
            state.keep(thread);
        }
    }
}

/// Connects `client` to the target, and copies its bytes both ways (this
/// thread upstream, another downstream) until the connection ends.
fn serve(shared: &Arc<Shared>, client: TcpStream) {
    let Ok(upstream) = TcpStream::connect_timeout(&shared.target, CONNECT_LIMIT) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    // Small messages (a query, its answer) go at once, as the two ends sent
    // them.
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let link = Arc::new(Link { client, upstream });
    let handshake = Arc::new(Handshake::default());
    let framer = |side| {
        shared
            .postgres
            .then(|| Framer::new(side, Arc::clone(&handshake)))
    };
    let up = framer(Side::Up);
    let down = framer(Side::Down);
    {
        let mut state = shared.lock();
        if state.stopped || state.fault == Fault::Reset {
            link.close();
            return;
        }
        state.links.retain(|link| link.strong_count() > 0);
        state.links.push(Arc::downgrade(&link));
        let started = thread::Builder::new()
            .name("idem-proxy-down".to_owned())
            .spawn({
                let shared = Arc::clone(shared);
                let link = Arc::clone(&link);
                move || pump(&shared, &link, Side::Down, down)
            });
        match started {
            Ok(thread) => state.keep(thread),
            Err(_) => {
                link.close();
                return;
            }
        }
    }
    pump(shared, &link, Side::Up, up);
}

/// A client's connection and the proxy's connection to the target for it.
struct Link {
    client: TcpStream,
    upstream: TcpStream,
}

impl Link {
    /// Shuts both connections down, both ways: the reads waiting on them
    /// end, and the writes fail.
    fn close(&self) {
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.upstream.shutdown(Shutdown::Both);
    }
}

/// Which way bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// From the client to the server.
    Up,
    /// From the server to the client.
    Down,
}

/// Copies the bytes going `side` until the connection ends, a fault ends
/// it, or the proxy is dropped.
fn pump(shared: &Shared, link: &Link, side: Side, mut framer: Option<Framer>) {
    let (mut from, mut to) = match side {
        Side::Up => (&link.client, &link.upstream),
        Side::Down => (&link.upstream, &link.client),
    };
    let mut buffer = vec![0; CHUNK];
    loop {
        // A stall reads nothing more.
        match shared.unstalled() {
            None | Some(Fault::Reset) => return link.close(),
            Some(_) => {}
        }
        let read = match from.read(&mut buffer) {
            Ok(0) => {
                // The end of one direction is passed on; the other goes on.
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(read) => read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return link.close(),
        };
        let chunk = &buffer[..read];
        // Framed whatever the fault, so that the messages are known when a
        // COMMIT fault is set.
        let commits = framer
            .as_mut()
            .map_or_else(Vec::new, |framer| framer.feed(chunk));
        // Nor does it forward what it had read.
        match shared.unstalled() {
            None | Some(Fault::Reset) => return link.close(),
            Some(Fault::Blackhole) => continue,
            Some(Fault::LoseAnswers) if side == Side::Down => {
                shared.lost_answers.fetch_add(1, Ordering::SeqCst);
                return link.close();
            }
            Some(Fault::Latency(latency)) => thread::sleep(latency),
            Some(_) => {}
        }
        if let Some(start) = commits.into_iter().find(|_| shared.loses(side)) {
            let _ = to.write_all(&chunk[..start]);
            return link.close();
        }
        if to.write_all(chunk).is_err() {
            return link.close();
        }
    }
}

/// What a connection's two directions tell each other about the start of
/// PostgreSQL's protocol.
#[derive(Debug, Default)]
struct Handshake {
    /// Encryption requests sent whose one-byte answer has not been read.
    awaiting: AtomicU32,
    /// The server accepted encryption: the bytes are no longer messages.
    encrypted: AtomicBool,
}

/// Reads one direction of a PostgreSQL connection as messages, chunk by
/// chunk, and finds the COMMITs in it: client messages that commit
/// ([`Side::Up`]), and the server's `CommandComplete` answers to them
/// ([`Side::Down`]).
///
/// A client first sends messages without a type byte (int32 length, int32
/// code: encryption requests, then the `StartupMessage`), each encryption
/// request answered by a single byte (`S` or `G` accepts, `N` refuses).
/// Every other message, both ways, is a type byte, an int32 length counting
/// itself, and a body.
#[derive(Debug)]
struct Framer {
    side: Side,
    handshake: Arc<Handshake>,
    /// ([`Side::Up`]) The `StartupMessage` has been read: every message
    /// has a type byte from now on.
    started: bool,
    /// The bytes are not PostgreSQL's messages (a length that cannot be):
    /// they are passed without looking any more.
    lost: bool,
    /// The current message's header: type byte and length, or length and
    /// code.
    head: [u8; 8],
    /// How many bytes of `head` are read.
    head_read: usize,
    /// How long the current message's header is (5 or 8); 0 between
    /// messages.
    head_len: usize,
    /// The current message's body length.
    body_len: usize,
    /// How many bytes of the body are still to come.
    left: usize,
    /// Whether the body is kept (up to [`KEPT`] bytes), to be looked at.
    keep: bool,
    body: Vec<u8>,
    /// ([`Side::Up`]) The prepared statements, by name: whether each
    /// commits.
    statements: HashMap<Vec<u8>, bool>,
    /// ([`Side::Up`]) The portals, by name: whether each commits.
    portals: HashMap<Vec<u8>, bool>,
}

impl Framer {
    fn new(side: Side, handshake: Arc<Handshake>) -> Self {
        Self {
            side,
            handshake,
            started: false,
            lost: false,
            head: [0; 8],
            head_read: 0,
            head_len: 0,
            body_len: 0,
            left: 0,
            keep: false,
            body: Vec::new(),
            statements: HashMap::new(),
            portals: HashMap::new(),
        }
    }

    /// Reads `chunk`, the next bytes of the direction, and answers where
    /// each COMMIT message it completes starts in `chunk` (0 for one that
    /// began in an earlier chunk).
    fn feed(&mut self, chunk: &[u8]) -> Vec<usize> {
        let mut commits = Vec::new();
        let mut start = 0;
        let mut at = 0;
        while at < chunk.len() && !self.lost && !self.handshake.encrypted.load(Ordering::SeqCst) {
            if self.head_len == 0 {
                start = at;
                if self.side == Side::Down && self.handshake.awaiting.load(Ordering::SeqCst) > 0 {
                    self.handshake.awaiting.fetch_sub(1, Ordering::SeqCst);
                    let answer = chunk[at];
                    // `E`: an error instead of an answer (a server without
                    // encryption support), a message like the others.
                    if answer != b'E' {
                        if matches!(answer, b'S' | b'G') {
                            self.handshake.encrypted.store(true, Ordering::SeqCst);
                        }
                        at += 1;
                        continue;
                    }
                }
                let typed = self.side == Side::Down || self.started;
                self.head_len = if typed { 5 } else { 8 };
                self.head_read = 0;
            }
            if self.head_read < self.head_len {
                let taken = (self.head_len - self.head_read).min(chunk.len() - at);
                self.head[self.head_read..self.head_read + taken]
                    .copy_from_slice(&chunk[at..at + taken]);
                self.head_read += taken;
                at += taken;
                if self.head_read < self.head_len {
                    break;
                }
                if !self.begin() {
                    self.lost = true;
                    break;
                }
            }
            let taken = self.left.min(chunk.len() - at);
            if self.keep {
                let room = KEPT.saturating_sub(self.body.len()).min(taken);
                self.body.extend_from_slice(&chunk[at..at + room]);
            }
            self.left -= taken;
            at += taken;
            if self.left == 0 {
                if self.end() {
                    commits.push(start);
                }
                self.head_len = 0;
                self.body.clear();
            }
        }
        commits
    }

    /// Reads the header just completed; `false` if no PostgreSQL message
    /// has it.
    fn begin(&mut self) -> bool {
        let typed = self.head_len == 5;
        let (kind, length, counted) = if typed {
            let length =
                u32::from_be_bytes([self.head[1], self.head[2], self.head[3], self.head[4]]);
            (self.head[0], length, 4)
        } else {
            let length =
                u32::from_be_bytes([self.head[0], self.head[1], self.head[2], self.head[3]]);
            (0, length, 8)
        };
        // The server refuses messages of 1 GiB or more.
        if length >= 1 << 30 {
            return false;
        }
        let Some(body_len) = (length as usize).checked_sub(counted) else {
            return false;
        };
        self.body_len = body_len;
        self.left = body_len;
        self.keep = typed
            && match self.side {
                Side::Up => matches!(kind, b'Q' | b'P' | b'B' | b'E' | b'C'),
                Side::Down => kind == b'C',
            };
        true
    }

    /// Reads the message just completed; answers whether it is a COMMIT.
    fn end(&mut self) -> bool {
        if self.head_len == 8 {
            let code = u32::from_be_bytes([self.head[4], self.head[5], self.head[6], self.head[7]]);
            match code {
                SSL_REQUEST | GSSENC_REQUEST => {
                    // Counted before the request is forwarded, so before
                    // the answer can come back.
                    self.handshake.awaiting.fetch_add(1, Ordering::SeqCst);
                }
                CANCEL_REQUEST => {}
                _ => self.started = true,
            }
            return false;
        }
        let body = self.body.as_slice();
        match (self.side, self.head[0]) {
            (Side::Down, b'C') => body == b"COMMIT\0",
            (Side::Up, b'Q') => {
                // A simple query ends the unnamed statement and portal.
                self.statements.remove(&b""[..]);
                self.portals.remove(&b""[..]);
                c_string(body).is_some_and(|(sql, _)| is_commit(sql))
            }
            (Side::Up, b'P') => {
                if let Some((name, rest)) = c_string(body) {
                    let commits = c_string(rest).is_some_and(|(sql, _)| is_commit(sql));
                    self.statements.insert(name.to_vec(), commits);
                }
                false
            }
            (Side::Up, b'B') => {
                if let Some((portal, rest)) = c_string(body) {
                    let statement = c_string(rest).map_or(&b""[..], |(name, _)| name);
                    let commits = self.statements.get(statement) == Some(&true);
                    self.portals.insert(portal.to_vec(), commits);
                }
                false
            }
            (Side::Up, b'E') => {
                c_string(body).is_some_and(|(portal, _)| self.portals.get(portal) == Some(&true))
            }
            (Side::Up, b'C') => {
                if let Some((&what, rest)) = body.split_first()
                    && let Some((name, _)) = c_string(rest)
                {
                    match what {
                        b'S' => self.statements.remove(name),
                        b'P' => self.portals.remove(name),
                        _ => None,
                    };
                }
                false
            }
            _ => false,
        }
    }
}

/// The NUL-terminated string that `bytes` starts with, and what follows it;
/// `None` without a NUL (a body cut at [`KEPT`] bytes).
fn c_string(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = bytes.iter().position(|&byte| byte == 0)?;
    Some((&bytes[..end], &bytes[end + 1..]))
}

/// Whether `sql`'s last statement (after the last `;` but a trailing one)
/// is `COMMIT` or `END`, optionally followed by `WORK` or `TRANSACTION`, in
/// any case.
fn is_commit(sql: &[u8]) -> bool {
    let Ok(sql) = std::str::from_utf8(sql) else {
        return false;
    };
    let sql = sql.trim_end_matches(|c: char| c == ';' || c.is_whitespace());
    let last = sql.rsplit(';').next().unwrap_or(sql);
    let mut words = last.split_whitespace();
    let first = words.next().unwrap_or("");
    let second = words.next();
    (first.eq_ignore_ascii_case("COMMIT") || first.eq_ignore_ascii_case("END"))
        && second.is_none_or(|word| {
            word.eq_ignore_ascii_case("WORK") || word.eq_ignore_ascii_case("TRANSACTION")
        })
        && words.next().is_none()
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Output, Stdio};
    use std::time::Instant;

    use tokio_postgres::{Client, NoTls};

    use super::*;
    use crate::TestPostgres;
    use crate::process;

    /// The shared cluster, a fresh database in it with an empty table `t`,
    /// and a PostgreSQL proxy to the cluster.
    fn setup(prefix: &str) -> (&'static TestPostgres, String, Proxy) {
        let cluster = TestPostgres::shared().unwrap();
        let database = cluster.fresh_database(prefix).unwrap();
        cluster.psql(&database, "CREATE TABLE t (x int)").unwrap();
        let proxy = Proxy::postgres((Ipv4Addr::LOCALHOST, cluster.port()).into()).unwrap();
        (cluster, database, proxy)
    }

    fn rows(cluster: &TestPostgres, database: &str) -> String {
        cluster.psql(database, "SELECT count(*) FROM t").unwrap()
    }

    /// `psql` through the proxy, each of `commands` a `-c` of its own (one
    /// simple query each); killed after 20 s, so that a test cannot hang.
    fn psql_through(proxy: &Proxy, database: &str, commands: &[&str]) -> Output {
        let dirs = crate::postgres::find_binaries().into_iter();
        let psql = process::find_in(dirs, "psql").expect("psql not found: install PostgreSQL");
        let mut command = Command::new(psql);
        command
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
            .args(["-h", "127.0.0.1", "-U", "postgres"])
            .args(["-p", &proxy.port().to_string(), "-d", database]);
        for sql in commands {
            command.args(["-c", sql]);
        }
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                break;
            }
            thread::sleep(Duration::from_millis(10));
        }
        child.wait_with_output().unwrap()
    }

    /// psql's exit status when the connection to the server was lost.
    const PSQL_CONNECTION_LOST: Option<i32> = Some(2);

    fn url(proxy: &Proxy, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", proxy.port())
    }

    /// A tokio-postgres client through the proxy (extended protocol, no
    /// encryption request).
    async fn connect(proxy: &Proxy, database: &str) -> Result<Client, tokio_postgres::Error> {
        let (client, connection) = tokio_postgres::connect(&url(proxy, database), NoTls).await?;
        tokio::spawn(connection);
        Ok(client)
    }

    #[test]
    fn simple_query_commit_answer_is_lost_and_the_commit_lands() {
        let (cluster, database, proxy) = setup("fault_answer_simple");
        proxy.set(Fault::LoseCommitAnswers { every: 1 });
        let output = psql_through(
            &proxy,
            &database,
            &["BEGIN; INSERT INTO t VALUES (1); COMMIT;"],
        );
        assert_eq!(
            output.status.code(),
            PSQL_CONNECTION_LOST,
            "{}",
            process::printed(&output)
        );
        assert_eq!(rows(cluster, &database), "1");
        assert_eq!(proxy.lost_commit_answers(), 1);
        assert_eq!(proxy.lost_commits(), 0);
        assert_eq!(proxy.connections(), 1);
    }

    #[tokio::test]
    async fn prepared_commit_answer_is_lost_and_the_commit_lands() {
        let (cluster, database, proxy) = setup("fault_answer_extended");
        let client = connect(&proxy, &database).await.unwrap();
        proxy.set(Fault::LoseCommitAnswers { every: 1 });
        let begin = client.prepare("BEGIN").await.unwrap();
        client.execute(&begin, &[]).await.unwrap();
        client
            .execute("INSERT INTO t VALUES ($1)", &[&1_i32])
            .await
            .unwrap();
        let commit = client.prepare("COMMIT").await.unwrap();
        let error = client.execute(&commit, &[]).await.unwrap_err();
        assert!(error.is_closed(), "{error:?}");
        assert_eq!(rows(cluster, &database), "1");
        assert_eq!(proxy.lost_commit_answers(), 1);
        assert_eq!(proxy.lost_commits(), 0);
    }

    #[tokio::test]
    async fn lost_commits_roll_back_simple_and_prepared() {
        let (cluster, database, proxy) = setup("fault_commit");
        proxy.set(Fault::LoseCommits { every: 1 });

        // Simple protocol: psql sends each -c as a query of its own.
        let output = psql_through(
            &proxy,
            &database,
            &["BEGIN", "INSERT INTO t VALUES (1)", "commit ;"],
        );
        assert_eq!(
            output.status.code(),
            PSQL_CONNECTION_LOST,
            "{}",
            process::printed(&output)
        );
        assert_eq!(rows(cluster, &database), "0");
        assert_eq!(proxy.lost_commits(), 1);

        // Extended protocol: Parse, Bind, Execute of a prepared COMMIT.
        let client = connect(&proxy, &database).await.unwrap();
        let begin = client.prepare("BEGIN").await.unwrap();
        client.execute(&begin, &[]).await.unwrap();
        client
            .execute("INSERT INTO t VALUES ($1)", &[&2_i32])
            .await
            .unwrap();
        let commit = client.prepare("COMMIT").await.unwrap();
        let error = client.execute(&commit, &[]).await.unwrap_err();
        assert!(error.is_closed(), "{error:?}");
        assert_eq!(rows(cluster, &database), "0");
        assert_eq!(proxy.lost_commits(), 2);
        assert_eq!(proxy.lost_commit_answers(), 0);

        // Back to no fault: a COMMIT goes through.
        proxy.set(Fault::None);
        let output = psql_through(
            &proxy,
            &database,
            &["BEGIN", "INSERT INTO t VALUES (3)", "COMMIT"],
        );
        assert!(output.status.success(), "{}", process::printed(&output));
        assert_eq!(rows(cluster, &database), "1");
        assert_eq!(proxy.lost_commits(), 2);
    }

    #[test]
    fn every_third_commit_answer_is_lost() {
        let (cluster, database, proxy) = setup("fault_every");
        proxy.set(Fault::LoseCommitAnswers { every: 3 });
        let lost: Vec<usize> = (0..9)
            .filter(|&i| {
                let sql = format!("BEGIN; INSERT INTO t VALUES ({i}); COMMIT;");
                let output = psql_through(&proxy, &database, &[&sql]);
                match output.status.code() {
                    Some(0) => false,
                    PSQL_CONNECTION_LOST => true,
                    _ => panic!("{}", process::printed(&output)),
                }
            })
            .collect();
        assert_eq!(lost, [2, 5, 8]);
        assert_eq!(rows(cluster, &database), "9");
        assert_eq!(proxy.lost_commit_answers(), 3);
        assert_eq!(proxy.connections(), 9);
    }

    #[tokio::test]
    async fn stall_reset_and_blackhole_then_none() {
        let (_cluster, database, proxy) = setup("fault_stall");

        // Stall: a query sent during it is answered once it is lifted.
        let client = connect(&proxy, &database).await.unwrap();
        proxy.set(Fault::Stall);
        let query = tokio::spawn(async move {
            let row = client.query_one("SELECT 41 + 1", &[]).await;
            (client, row.map(|row| row.get::<_, i32>(0)))
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!query.is_finished(), "answered through a stalled proxy");
        proxy.set(Fault::None);
        let (client, answer) = tokio::time::timeout(Duration::from_secs(10), query)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer.unwrap(), 42);

        // Reset: the open connection is closed, and a new one too.
        proxy.set(Fault::Reset);
        let error = client.simple_query("SELECT 1").await.unwrap_err();
        assert!(error.is_closed(), "{error:?}");
        let refused = connect(&proxy, &database).await;
        assert!(refused.is_err(), "connected through a proxy that resets");
        assert_eq!(proxy.connections(), 2);

        // Blackhole: neither an open connection nor a new one answers.
        proxy.set(Fault::None);
        let client = connect(&proxy, &database).await.unwrap();
        proxy.set(Fault::Blackhole);
        let limit = Duration::from_secs(1);
        let (query, connected) = tokio::join!(
            tokio::time::timeout(limit, client.simple_query("SELECT 1")),
            tokio::time::timeout(limit, connect(&proxy, &database)),
        );
        assert!(query.is_err(), "answered through a black hole: {query:?}");
        assert!(connected.is_err(), "connected through a black hole");
        assert_eq!(proxy.connections(), 4);

        // None again: a new connection works.
        proxy.set(Fault::None);
        let client = connect(&proxy, &database).await.unwrap();
        let row = client.query_one("SELECT 7", &[]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 7);
        assert_eq!(proxy.connections(), 5);
        assert_eq!(proxy.lost_commits() + proxy.lost_commit_answers(), 0);
    }

    /// A server that echoes what one connection sends, until its end.
    fn echo() -> (SocketAddr, JoinHandle<()>) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut buffer = [0; 1024];
            loop {
                match stream.read(&mut buffer) {
                    Ok(0) | Err(_) => return,
                    Ok(read) => {
                        if stream.write_all(&buffer[..read]).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        (addr, server)
    }

    /// A TCP proxy to an echo server, a connection through it (reads give
    /// up after 5 s), and the server's thread.
    fn echo_through() -> (Proxy, TcpStream, JoinHandle<()>) {
        let (target, server) = echo();
        let proxy = Proxy::tcp(target).unwrap();
        let stream = TcpStream::connect(proxy.addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        (proxy, stream, server)
    }

    #[test]
    fn tcp_stall_holds_bytes_and_drop_closes_everything() {
        let (proxy, mut stream, server) = echo_through();
        let mut answer = [0; 4];
        stream.write_all(b"ping").unwrap();
        stream.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"ping");

        proxy.set(Fault::Stall);
        stream.write_all(b"pong").unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let held = stream.read(&mut answer).unwrap_err();
        assert!(
            matches!(
                held.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            "{held:?}"
        );
        proxy.set(Fault::None);
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        stream.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"pong");

        let addr = proxy.addr();
        drop(proxy);
        assert_eq!(stream.read(&mut answer).unwrap(), 0, "open after the drop");
        assert!(
            TcpStream::connect(addr).is_err(),
            "listening after the drop"
        );
        server.join().unwrap();
    }

    #[test]
    fn latency_holds_each_chunk_both_ways() {
        let (proxy, mut stream, server) = echo_through();
        let mut answer = [0; 4];
        let round_trip = |stream: &mut TcpStream, answer: &mut [u8; 4]| {
            let sent = Instant::now();
            stream.write_all(b"ping").unwrap();
            stream.read_exact(answer).unwrap();
            assert_eq!(answer, b"ping");
            sent.elapsed()
        };
        round_trip(&mut stream, &mut answer);
        proxy.set(Fault::Latency(Duration::from_millis(150)));
        let slow = round_trip(&mut stream, &mut answer);
        // 150 ms up, 150 ms down.
        assert!(slow >= Duration::from_millis(300), "{slow:?}");
        proxy.set(Fault::None);
        round_trip(&mut stream, &mut answer);
        drop(proxy);
        server.join().unwrap();
    }

    #[test]
    #[should_panic(expected = "Proxy::postgres")]
    fn tcp_refuses_commit_faults() {
        let proxy = Proxy::tcp((Ipv4Addr::LOCALHOST, 9).into()).unwrap();
        proxy.set(Fault::LoseCommits { every: 1 });
    }

    #[test]
    #[should_panic(expected = "counts from 1")]
    fn every_zero_is_refused() {
        let proxy = Proxy::postgres((Ipv4Addr::LOCALHOST, 9).into()).unwrap();
        proxy.set(Fault::LoseCommitAnswers { every: 0 });
    }

    #[test]
    fn commit_statements() {
        for sql in [
            "COMMIT",
            "commit",
            "  Commit ; ",
            "END",
            "commit work",
            "END TRANSACTION;",
            "BEGIN; INSERT INTO t VALUES (1); COMMIT;",
        ] {
            assert!(is_commit(sql.as_bytes()), "{sql:?}");
        }
        for sql in [
            "",
            "BEGIN",
            "COMMIT PREPARED 'x'",
            "COMMIT; SELECT 1",
            "ROLLBACK",
            "SELECT 'COMMIT'",
            "commit and chain",
        ] {
            assert!(!is_commit(sql.as_bytes()), "{sql:?}");
        }
    }

    fn typed(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut message = vec![kind];
        message.extend_from_slice(&(u32::try_from(body.len()).unwrap() + 4).to_be_bytes());
        message.extend_from_slice(body);
        message
    }

    fn untyped(code: u32, rest: &[u8]) -> Vec<u8> {
        let mut message = (u32::try_from(rest.len()).unwrap() + 8)
            .to_be_bytes()
            .to_vec();
        message.extend_from_slice(&code.to_be_bytes());
        message.extend_from_slice(rest);
        message
    }

    /// Where the framer places a message at `start..end` of a stream read in
    /// chunks of `size` bytes: its start, or the start of the chunk that
    /// completes it when it began in an earlier one.
    fn cut(start: usize, end: usize, size: usize) -> usize {
        start.max((end - 1) / size * size)
    }

    /// Feeds `stream` to a new framer in chunks of `size` bytes; answers the
    /// COMMITs' starts, as offsets in `stream`.
    fn commits_in(
        side: Side,
        handshake: &Arc<Handshake>,
        stream: &[u8],
        size: usize,
    ) -> Vec<usize> {
        let mut framer = Framer::new(side, Arc::clone(handshake));
        let mut found = Vec::new();
        for (index, chunk) in stream.chunks(size).enumerate() {
            found.extend(framer.feed(chunk).into_iter().map(|at| index * size + at));
        }
        found
    }

    #[test]
    fn framing_finds_commits_whatever_the_chunks() {
        // Client: SSLRequest (answered N), startup, a prepared COMMIT
        // executed, a simple COMMIT, and a portal of another statement.
        let mut up = untyped(SSL_REQUEST, b"");
        up.extend(untyped(196_608, b"user\0postgres\0\0"));
        up.extend(typed(b'P', b"s1\0COMMIT\0\0\0"));
        up.extend(typed(b'S', b""));
        up.extend(typed(b'B', b"\0s1\0\0\0\0\0\0\0"));
        let execute = up.len();
        up.extend(typed(b'E', b"\0\0\0\0\0"));
        let execute = execute..up.len();
        up.extend(typed(b'S', b""));
        let query = up.len();
        up.extend(typed(b'Q', b"commit;\0"));
        let query = query..up.len();
        up.extend(typed(b'P', b"\0SELECT 1\0\0\0"));
        up.extend(typed(b'B', b"\0\0\0\0\0\0\0\0"));
        up.extend(typed(b'E', b"\0\0\0\0\0"));
        // The server: N, authentication ok, then the answers.
        let mut down = vec![b'N'];
        down.extend(typed(b'R', &[0; 4]));
        down.extend(typed(b'C', b"BEGIN\0"));
        let answer = down.len();
        down.extend(typed(b'C', b"COMMIT\0"));
        let answer = answer..down.len();
        down.extend(typed(b'Z', b"I"));
        down.extend(typed(b'C', b"ROLLBACK\0"));
        for size in [1, 2, 3, 7, 64, 4096] {
            let handshake = Arc::new(Handshake::default());
            // The request is read before its answer.
            let up_found = commits_in(Side::Up, &handshake, &up, size);
            let expected = [
                cut(execute.start, execute.end, size),
                cut(query.start, query.end, size),
            ];
            assert_eq!(up_found, expected, "chunks of {size}");
            assert_eq!(handshake.awaiting.load(Ordering::SeqCst), 1);
            let down_found = commits_in(Side::Down, &handshake, &down, size);
            let expected = [cut(answer.start, answer.end, size)];
            assert_eq!(down_found, expected, "chunks of {size}");
            assert_eq!(handshake.awaiting.load(Ordering::SeqCst), 0);
            assert!(!handshake.encrypted.load(Ordering::SeqCst));
        }
    }

    #[test]
    fn accepted_encryption_stops_the_framing() {
        let handshake = Arc::new(Handshake::default());
        let mut up = Framer::new(Side::Up, Arc::clone(&handshake));
        let mut down = Framer::new(Side::Down, Arc::clone(&handshake));
        assert!(up.feed(&untyped(SSL_REQUEST, b"")).is_empty());
        let mut answer = vec![b'S'];
        answer.extend(typed(b'C', b"COMMIT\0"));
        assert!(down.feed(&answer).is_empty());
        assert!(handshake.encrypted.load(Ordering::SeqCst));
        assert!(up.feed(&typed(b'Q', b"COMMIT\0")).is_empty());
    }
}
