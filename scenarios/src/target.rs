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
    /// use idem_scenarios::Target;
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

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}
