//! A running scenario app, as the suite sees it.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Mutex;

/// A scenario app listening on 127.0.0.1: its base URL, and a guard that stops
/// the server when the target is dropped.
pub struct Target {
    base: String,
    // A mutex so that any `Send` guard makes a `Sync` target: cases hold
    // `&Target` across awaits in `Send` futures.
    _guard: Mutex<Box<dyn Send>>,
}

impl Target {
    /// The app listening on `addr`; `guard` is dropped with the target and
    /// should stop the server then (abort its task, stop its handle).
    ///
    /// ```
    /// use idem_http_suite::Target;
    ///
    /// let target = Target::new("127.0.0.1:8080".parse().unwrap(), ());
    /// assert_eq!(target.url("/required?status=200"), "http://127.0.0.1:8080/required?status=200");
    /// ```
    pub fn new(addr: SocketAddr, guard: impl Send + 'static) -> Self {
        Self {
            base: format!("http://{addr}"),
            _guard: Mutex::new(Box::new(guard)),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The URL of `path_and_query` (which starts with `/`).
    pub fn url(&self, path_and_query: &str) -> String {
        format!("{}{path_and_query}", self.base)
    }
}

/// The receive buffer [`bind`] gives a scenario app's connections (Linux
/// doubles it).
pub const RECEIVE_BUFFER: u32 = 64 * 1024;

/// A listener on 127.0.0.1, port 0, for a scenario app, whose connections have
/// a fixed receive buffer of [`RECEIVE_BUFFER`] bytes; call it within a Tokio
/// runtime (actix-web takes it as `into_std()`).
///
/// Left to itself, Linux grows a connection's receive buffer while the app
/// reads fast, up to `net.ipv4.tcp_rmem`'s maximum (several MiB): what a client
/// sees accepted would then be what the app read plus an unknown share held by
/// the kernel. Fixed, that share is known, and
/// `refused_body_is_read_within_its_bound_then_closed` can tell what the app
/// read.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> std::io::Result<()> {
/// let listener = idem_http_suite::bind()?;
/// assert!(listener.local_addr()?.ip().is_loopback());
/// # Ok(())
/// # }
/// ```
pub fn bind() -> std::io::Result<tokio::net::TcpListener> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    // Set on the listener, the size (and Linux's leaving it alone) is
    // inherited by every connection it accepts.
    socket.set_recv_buffer_size(RECEIVE_BUFFER)?;
    socket.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    socket.listen(1024)
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}
