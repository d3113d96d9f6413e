//! The transactional outbox's broker-neutral half: the [`Event`] an
//! application stages in its own transaction (idem-diesel's `Outbox`), and
//! [`Publish`], what a broker crate implements so that a relay can send staged
//! events to it (idem-rabbitmq's `OutboxPublisher`).
//!
//! An effect that must tell other services is two writes: the database and
//! the broker. The outbox makes them one: the event is written in the
//! effect's transaction, with an id fixed at that moment ([`Event::id`], a
//! UUID v7), and a relay publishes it at least once, with that id as the
//! message id, after the commit. A consumer's inbox deduplicates by the id,
//! so a republished event (a relay that crashed before it marked the event
//! sent) is applied once.
//!
//! ```
//! use idem_core::outbox::Event;
//!
//! let event = Event::new("payments", "acc_1", r#"{"account_id":"acc_1","amount":500}"#)
//!     .header("content-type", "application/json");
//! assert_eq!(event.destination(), "payments");
//! assert_eq!(event.key(), "acc_1");
//! assert_eq!(event.id().get_version_num(), 7);
//! ```

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use uuid::Uuid;

use crate::StoredResponse;
use crate::store::BoxError;

/// One event: where it goes (a queue, a topic), its key (events with the same
/// key and destination leave in the order they were staged), its payload
/// and headers, and its id, fixed when the event is made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    id: Uuid,
    destination: String,
    key: String,
    payload: Bytes,
    headers: Vec<(String, Bytes)>,
}

/// The future a [`Publish`] answers.
pub type PublishFuture<'a> = Pin<Box<dyn Future<Output = Result<(), PublishError>> + Send + 'a>>;

/// Sends one event to a broker, and answers only once the broker has taken
/// it (RabbitMQ's publisher confirm, Kafka's acknowledgement): the relay
/// marks the event sent on `Ok` alone.
///
/// The event's [`id`](Event::id) must travel as the message's id (AMQP
/// `message_id`, Kafka's `message_id` header), so that a consumer's inbox
/// recognises an event published twice.
pub trait Publish: Send + Sync + 'static {
    /// Publishes `event` to its destination and waits for the broker to
    /// confirm it.
    fn publish<'a>(&'a self, event: &'a Event) -> PublishFuture<'a>;
}

/// Why an event was not published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The broker or the connection failed (down, unreachable, no queue yet):
    /// the relay tries again later, with full-jitter backoff.
    #[error("the broker did not take the event")]
    Unavailable(#[source] BoxError),
    /// The event can never be published as it stands (too large, a name the
    /// protocol cannot carry, refused by the broker): the relay parks it with
    /// this reason, and goes on with the others. The reason must not quote
    /// the payload.
    #[error("the event can never be published: {0}")]
    Refused(String),
}

impl Event {
    /// An event for `destination`, keyed by `key`, with a new time-ordered id
    /// (UUID v7) and no headers.
    pub fn new(
        destination: impl Into<String>,
        key: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> Self {
        Self {
            id: Uuid::now_v7(),
            destination: destination.into(),
            key: key.into(),
            payload: payload.into(),
            headers: Vec::new(),
        }
    }

    /// An event as it was staged, with its id: what a relay reads back.
    pub fn staged(
        id: Uuid,
        destination: impl Into<String>,
        key: impl Into<String>,
        payload: impl Into<Bytes>,
        headers: Vec<(String, Bytes)>,
    ) -> Self {
        Self {
            id,
            destination: destination.into(),
            key: key.into(),
            payload: payload.into(),
            headers,
        }
    }

    /// Adds a header (published as a string header where the broker has them).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The event's id: its message id on the broker.
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// Where it goes: a queue (RabbitMQ), a topic (Kafka).
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// Its key: the unit of order (and Kafka's record key).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Its payload.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// Its headers, in order.
    pub fn headers(&self) -> &[(String, Bytes)] {
        &self.headers
    }

    /// The headers in one byte string, for a database column: each name and
    /// value prefixed by its length (u32, big-endian), as
    /// [`StoredResponse::encode_headers`] writes them.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            for part in [name.as_bytes(), value.as_ref()] {
                let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(part);
            }
        }
        out
    }

    /// Decodes what [`encode_headers`](Self::encode_headers) wrote; `None` if
    /// the bytes are not such an encoding.
    pub fn decode_headers(bytes: &[u8]) -> Option<Vec<(String, Bytes)>> {
        StoredResponse::decode_headers(bytes).map(|headers| {
            headers
                .into_iter()
                .map(|header| (header.name.into_owned(), header.value))
                .collect()
        })
    }
}

impl PublishError {
    /// A transient failure, with its cause.
    pub fn unavailable(error: impl Into<BoxError>) -> Self {
        Self::Unavailable(error.into())
    }

    /// Whether the event must be parked rather than retried.
    pub fn is_refused(&self) -> bool {
        matches!(self, Self::Refused(_))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn headers_survive_their_encoding() {
        let event = Event::new("q", "k", "{}")
            .header("content-type", "application/json")
            .header("x-empty", "");
        let decoded = Event::decode_headers(&event.encode_headers()).unwrap();
        assert_eq!(decoded, event.headers());
        assert_eq!(Event::decode_headers(&[]).unwrap(), vec![]);
        assert!(Event::decode_headers(&[0, 0, 0, 9, 1]).is_none());
    }

    #[test]
    fn ids_are_time_ordered() {
        let first = Event::new("q", "k", "1");
        let second = Event::new("q", "k", "2");
        assert_eq!(first.id().get_version_num(), 7);
        assert!(first.id() < second.id());
    }
}
