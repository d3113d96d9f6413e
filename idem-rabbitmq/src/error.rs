//! Why a broker step failed.

use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};

/// Why a consumer, a dead-letter operation or a publish failed. It never
/// holds the AMQP URL's password, a message id or a body.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The inbox is not ready ([`Inbox::readiness`](idem_core::consume::Inbox::readiness)):
    /// its tables were not verified in this process. The consumer did not
    /// start; the message names the fix.
    #[error("the consumer did not start: {0}")]
    NotReady(#[from] idem_core::store::NotReady),
    /// The AMQP URL could not be parsed (the URL itself is not repeated).
    #[error("the AMQP URL is invalid: {0}")]
    InvalidUrl(String),
    /// A step on the broker failed: connecting, declaring, publishing,
    /// acknowledging.
    #[error("RabbitMQ: could not {step}")]
    Broker {
        /// What was being done.
        step: String,
        /// The broker's or the connection's error.
        #[source]
        source: lapin::Error,
    },
    /// Declaring a queue failed; `PRECONDITION_FAILED` means it exists with
    /// other arguments (another queue type, another delivery limit).
    #[error("RabbitMQ: could not declare the queue {queue:?}")]
    Declare {
        /// The queue.
        queue: String,
        /// The broker's error.
        #[source]
        source: lapin::Error,
    },
    /// The broker did not take a published message: it refused it (`nack`),
    /// or no queue was bound to where it was sent.
    #[error("RabbitMQ did not confirm the message sent to {destination:?}: {why}")]
    NotConfirmed {
        /// The queue it was sent to.
        destination: String,
        /// Why: `unroutable` or `refused`.
        why: &'static str,
    },
    /// A queue does not exist.
    #[error("the queue {0:?} does not exist")]
    NoSuchQueue(String),
    /// The broker ended the subscription (the queue was deleted, say): the
    /// consumer subscribes again.
    #[error("RabbitMQ cancelled the subscription")]
    Cancelled,
    /// A delivery's task ended without settling it (a bug).
    #[error("{0}")]
    Internal(String),
    /// A name AMQP cannot carry (a queue name, a message id, a header name:
    /// at most 255 bytes).
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    pub(crate) fn broker(step: impl Into<String>) -> impl FnOnce(lapin::Error) -> Self {
        let step = step.into();
        move |source| Self::Broker { step, source }
    }

    /// Whether reconnecting cannot help: the broker refused the credentials,
    /// the virtual host or a permission, or a queue exists with other
    /// arguments than the ones declared (another queue type, say). The consumer stops on such
    /// an error instead of reconnecting.
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::InvalidUrl(_) | Self::Invalid(_) | Self::NotReady(_) => true,
            Self::Declare { source, .. } => amqp_error(source).is_some_and(|kind| {
                matches!(
                    kind,
                    AMQPErrorKind::Soft(
                        AMQPSoftError::ACCESSREFUSED | AMQPSoftError::PRECONDITIONFAILED
                    )
                )
            }),
            Self::Broker { source, .. } => match source.kind() {
                lapin::ErrorKind::InvalidProtocolVersion(_)
                | lapin::ErrorKind::AuthProviderError(_) => true,
                _ => amqp_error(source).is_some_and(|kind| {
                    matches!(
                        kind,
                        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                            | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
                    )
                }),
            },
            Self::NotConfirmed { .. }
            | Self::NoSuchQueue(_)
            | Self::Cancelled
            | Self::Internal(_) => false,
        }
    }
}

fn amqp_error(error: &lapin::Error) -> Option<&AMQPErrorKind> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(error) => Some(error.kind()),
        _ => None,
    }
}
