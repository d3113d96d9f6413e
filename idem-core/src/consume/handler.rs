//! The application's part: a handler, and how it fails.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;

use futures_util::FutureExt;

use super::Attempt;
use crate::store::BoxError;

/// The future a [`Handler`] answers: `Send`, borrowing the attempt and the
/// transaction.
pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// Applies one message's effect, on the inbox's transaction `Tx` (for
/// idem-diesel's inboxes, the open `AsyncPgConnection` or SQLite connection
/// the inbox row is written on; `()` for an inbox without one).
///
/// Any `Fn(Attempt<'_>, &mut Tx) -> HandlerFuture<'_>` closure is a handler;
/// wrap it in [`handler`] so that Rust infers its signature:
///
/// ```
/// use idem_core::consume::{Attempt, HandlerError, handler};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { account_id: String, amount: i64 }
///
/// let apply = handler(|attempt: Attempt<'_>, _tx: &mut ()| {
///     Box::pin(async move {
///         let payment: Payment = attempt.json().map_err(HandlerError::permanent)?;
///         if payment.amount <= 0 {
///             return Err(HandlerError::permanent("the amount must be positive"));
///         }
///         // ... apply it on the transaction ...
///         Ok(())
///     })
/// });
/// # let _ = apply;
/// ```
pub trait Handler<Tx: ?Sized>: Send + Sync {
    /// Applies `attempt`'s message on `tx`. An error rolls the transaction
    /// back; whether it is retried is the [`ConsumerPolicy`](super::ConsumerPolicy)'s
    /// decision ([`HandlerError`]).
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut Tx) -> HandlerFuture<'a>;

    /// The batch handler and the most messages it takes at once, when this
    /// handler applies batches ([`Batch`](super::Batch)): a broker crate's
    /// consumer then hands it what it takes in units of that many. `None`
    /// (one at a time) by default.
    fn as_batch(&self) -> Option<(&dyn super::BatchHandler<Tx>, usize)> {
        None
    }
}

impl<Tx, F> Handler<Tx> for F
where
    Tx: ?Sized,
    F: for<'a> Fn(Attempt<'a>, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync,
{
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut Tx) -> HandlerFuture<'a> {
        self(attempt, tx)
    }
}

/// Fixes a closure's signature as a [`Handler`]'s (closures passed straight
/// to a function with the bound get their lifetimes right).
pub fn handler<Tx, F>(f: F) -> F
where
    Tx: ?Sized,
    F: for<'a> Fn(Attempt<'a>, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync,
{
    f
}

/// Why a handler failed, and whether retrying can help.
///
/// Any error converts into one (`?` works on any `Error + Send + Sync`) as
/// *unclassified*: the [`ConsumerPolicy`](super::ConsumerPolicy) then decides
/// (its [`permanent_when`](super::ConsumerPolicy::permanent_when), then the
/// inbox's knowledge of its database's errors), and transient is the default.
/// [`permanent`](Self::permanent) and [`transient`](Self::transient) decide
/// here and now.
pub struct HandlerError {
    kind: ErrorKind,
    source: BoxError,
}

/// How a [`HandlerError`] was classified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Not said: the policy decides.
    Unclassified,
    /// May succeed on a retry (a timeout, a deadlock, a service down).
    Transient,
    /// Can never succeed (the message's own shape, a constraint it breaks):
    /// dead-lettered at once.
    Permanent,
    /// The handler panicked: retried like a transient error.
    Panicked,
}

impl HandlerError {
    /// A failure that can never succeed on a retry: the message is
    /// dead-lettered at once.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        Self {
            kind: ErrorKind::Permanent,
            source: source.into(),
        }
    }

    /// A failure that a retry may get past, whatever the policy's classifier
    /// says.
    pub fn transient(source: impl Into<BoxError>) -> Self {
        Self {
            kind: ErrorKind::Transient,
            source: source.into(),
        }
    }

    pub(crate) fn panicked(detail: String) -> Self {
        Self {
            kind: ErrorKind::Panicked,
            source: detail.into(),
        }
    }

    /// How it was classified.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The error.
    pub fn source_error(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.source
    }

    /// The error and its sources on one line: the dead letter's reason.
    pub fn reason(&self) -> String {
        crate::log::error_chain(&*self.source)
    }
}

impl<E: Into<BoxError>> From<E> for HandlerError {
    fn from(error: E) -> Self {
        Self {
            kind: ErrorKind::Unclassified,
            source: error.into(),
        }
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("kind", &self.kind)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

/// The application's handler, as the protocol hands it to an inbox: a panic
/// becomes [`ErrorKind::Panicked`] (so the inbox rolls back and counts it),
/// and the time it ran is measured.
pub(crate) struct Guarded<'h, H: ?Sized>(pub(crate) &'h H);

impl<Tx: ?Sized, H: Handler<Tx> + ?Sized> Handler<Tx> for Guarded<'_, H> {
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut Tx) -> HandlerFuture<'a> {
        guard(self.0, attempt, tx)
    }
}

/// Runs `handler` with panics caught and its time measured.
pub(crate) fn guard<'a, Tx: ?Sized, H: Handler<Tx> + ?Sized>(
    handler: &'a H,
    attempt: Attempt<'a>,
    tx: &'a mut Tx,
) -> HandlerFuture<'a> {
    caught(handler.handle(attempt, tx))
}

/// Runs a batch handler with panics caught and its time measured.
pub(crate) fn guard_batch<'a, Tx: ?Sized>(
    handler: &'a (dyn super::BatchHandler<Tx> + 'a),
    batch: &'a [Attempt<'a>],
    tx: &'a mut Tx,
) -> HandlerFuture<'a> {
    caught(handler.handle(batch, tx))
}

/// `handled`, its panic a [`ErrorKind::Panicked`] error, its time measured
/// from now.
fn caught(handled: HandlerFuture<'_>) -> HandlerFuture<'_> {
    let timer = crate::metrics::Timer::start();
    Box::pin(async move {
        let ran = AssertUnwindSafe(handled).catch_unwind().await;
        super::metrics::handler_time(timer);
        match ran {
            Ok(result) => result,
            Err(panic) => {
                let detail = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".to_owned());
                Err(HandlerError::panicked(format!(
                    "the handler panicked: {detail}"
                )))
            }
        }
    })
}
