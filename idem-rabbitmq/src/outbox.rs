//! The outbox's publisher on RabbitMQ: what a relay (idem-diesel's
//! `Outbox::relay`) publishes staged events with.

use idem_core::consume::Message;
use idem_core::outbox::{Event, Publish, PublishError, PublishFuture};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};

use crate::{Error, Publisher};

/// Publishes outbox events to RabbitMQ: each event to the queue named by its
/// destination (through the default exchange), persistent, with the event's
/// id as its `message_id` and its headers as string headers, confirmed by the
/// broker before the relay marks it sent.
///
/// What the relay does with a failure:
///
/// - **parked** (can never be published, [`PublishError::Refused`]): a
///   payload over [`max_message_size`](Self::max_message_size), one the
///   broker refuses as too large (`PRECONDITION_FAILED`), a header name AMQP
///   cannot carry;
/// - **retried** with full jitter ([`PublishError::Unavailable`]): anything
///   else, a refusal that can pass included: a message the broker refused
///   (`basic.nack`, as a queue capped with `overflow: reject-publish` does
///   while it is full), a broker down or unreachable, a queue that does not
///   exist yet (unroutable). The connection is opened again at the next
///   publish.
///
/// ```no_run
/// use idem_rabbitmq::OutboxPublisher;
///
/// # async fn run() -> Result<(), idem_rabbitmq::Error> {
/// let publisher = OutboxPublisher::connect("amqp://guest:guest@127.0.0.1:5672/%2f")
///     .await?
///     .max_message_size(1024 * 1024);
/// // idem-diesel: `tokio::spawn(outbox.relay(publisher)?.run(shutdown));`
/// # let _ = publisher;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct OutboxPublisher {
    publisher: Publisher,
    max_message_size: Option<usize>,
}

impl OutboxPublisher {
    /// Connects to the broker at `url` (`amqp://user:password@host:port/vhost`).
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Ok(Self::new(Publisher::connect(url).await?))
    }

    /// Publishes through `publisher`.
    pub fn new(publisher: Publisher) -> Self {
        Self {
            publisher,
            max_message_size: None,
        }
    }

    /// Parks an event whose payload is longer than `bytes` without sending
    /// it (default: no limit here; the broker's own, `max_message_size`,
    /// still parks what it refuses).
    #[must_use]
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = Some(bytes);
        self
    }

    /// Closes the connection.
    pub async fn close(self) {
        self.publisher.close().await;
    }
}

impl Publish for OutboxPublisher {
    fn publish<'a>(&'a self, event: &'a Event) -> PublishFuture<'a> {
        Box::pin(async move {
            let size = event.payload().len();
            if let Some(max) = self.max_message_size
                && size > max
            {
                return Err(PublishError::Refused(format!(
                    "the payload has {size} bytes, over the {max}-byte limit"
                )));
            }
            let mut message = Message::new(event.payload().clone()).id(event.id().to_string());
            for (name, value) in event.headers() {
                message = message.header(name.clone(), value.clone());
            }
            match self.publisher.publish(event.destination(), &message).await {
                Ok(_) => Ok(()),
                Err(error) => Err(classify(error, size)),
            }
        })
    }
}

/// Whether a publish that failed can ever succeed as it stands.
fn classify(error: Error, size: usize) -> PublishError {
    match &error {
        Error::Invalid(reason) => PublishError::Refused(reason.clone()),
        Error::Broker { source, .. } => match too_large(source, size) {
            Some(reason) => PublishError::Refused(reason),
            None => PublishError::unavailable(error),
        },
        _ => PublishError::unavailable(error),
    }
}

/// The broker's reason when it closed the channel because a message of
/// `size` bytes is over its `max_message_size`. The channel is shared by
/// concurrent publishes, which all see its closing: only the message whose
/// size the reason names (`message size N is larger than …`) is refused, the
/// others are tried again.
fn too_large(error: &lapin::Error, size: usize) -> Option<String> {
    let lapin::ErrorKind::ProtocolError(amqp) = error.kind() else {
        return None;
    };
    if !matches!(
        amqp.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    ) {
        return None;
    }
    // The broker's text names the sizes, never the body.
    let reason = amqp.get_message().as_str();
    let named = reason
        .split("message size ")
        .nth(1)?
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse::<usize>()
        .ok()?;
    (named == size).then(|| format!("the broker refused it: {reason}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use lapin::protocol::AMQPError;

    #[test]
    fn only_the_message_the_broker_names_is_too_large() {
        let closed = lapin::Error::from(lapin::ErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED),
            "PRECONDITION_FAILED - message size 2097152 is larger than configured max size 1048576"
                .into(),
        )));
        assert!(
            too_large(&closed, 2_097_152)
                .unwrap()
                .contains("larger than")
        );
        assert_eq!(too_large(&closed, 120), None);
    }
}
