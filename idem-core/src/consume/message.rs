//! What a broker delivered, and what a handler is given of it.

use std::fmt::{self, Write as _};
use std::ops::Deref;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::{Fingerprint, Redacted};

/// A message as a broker delivered it, translated by a broker crate: its id,
/// its body, its headers and what the broker says of its redelivery.
///
/// ```
/// use idem_core::consume::Message;
///
/// let message = Message::new(r#"{"account_id": "acc_1", "amount": 5}"#)
///     .id("m-1")
///     .header("content-type", "application/json");
/// assert_eq!(message.message_id(), Some("m-1"));
/// assert_eq!(message.header_str("content-type"), Some("application/json"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Message {
    id: Option<String>,
    body: Bytes,
    headers: Vec<(String, Bytes)>,
    redelivered: bool,
    redriven: bool,
    delivery_count: Option<u32>,
    /// Why the message's id could not be read, when it could not.
    id_problem: Option<&'static str>,
}

impl Message {
    /// A message with `body`, no id and no headers.
    pub fn new(body: impl Into<Bytes>) -> Self {
        Self {
            id: None,
            body: body.into(),
            headers: Vec::new(),
            redelivered: false,
            redriven: false,
            delivery_count: None,
            id_problem: None,
        }
    }

    /// Marks the message's id as present but unreadable (`reason`, e.g.
    /// [`UNREADABLE_MESSAGE_ID`](super::UNREADABLE_MESSAGE_ID): not UTF-8;
    /// [`AMBIGUOUS_MESSAGE_ID`](super::AMBIGUOUS_MESSAGE_ID): two that
    /// differ): the protocol dead-letters it at once with that reason,
    /// whatever the policy says of a message without an id. Keyed by
    /// anything else (its body, a broker's own id), a producer's resend would
    /// be applied twice.
    #[must_use]
    pub fn id_problem(mut self, reason: &'static str) -> Self {
        self.id_problem = Some(reason);
        self
    }

    /// Why the message's id could not be read, if it could not.
    pub fn get_id_problem(&self) -> Option<&'static str> {
        self.id_problem
    }

    /// Sets the producer's message id (AMQP `message_id`, a Kafka header, an
    /// SQS attribute): the idempotency key. An empty id counts as none.
    #[must_use]
    pub fn id(mut self, id: impl Into<String>) -> Self {
        let id = id.into();
        self.id = (!id.is_empty()).then_some(id);
        self
    }

    /// Adds a header (names compare ASCII case-insensitively).
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Marks the message as redelivered by the broker (AMQP `redelivered`).
    #[must_use]
    pub fn redelivered(mut self, redelivered: bool) -> Self {
        self.redelivered = redelivered;
        self
    }

    /// Marks the message as re-driven from the dead-letter queue by hand
    /// (a broker crate's redrive sets a header that says so): the inbox
    /// forgets its dead letter before the message is processed, so it runs
    /// again from attempt 1. A redrive that can reach the inbox itself calls
    /// [`Protocol::redrive`](super::Protocol::redrive) instead.
    #[must_use]
    pub fn redriven(mut self, redriven: bool) -> Self {
        self.redriven = redriven;
        self
    }

    /// How many times the broker says it delivered the message, this time
    /// included (SQS `ApproximateReceiveCount`, a quorum queue's
    /// `x-delivery-count` plus one), when it counts.
    #[must_use]
    pub fn delivery_count(mut self, count: u32) -> Self {
        self.delivery_count = Some(count);
        self
    }

    /// The producer's message id, if it set one.
    pub fn message_id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Every header, in the order the broker gave them.
    pub fn headers(&self) -> &[(String, Bytes)] {
        &self.headers
    }

    /// The first header named `name` (ASCII case-insensitively).
    pub fn header_value(&self, name: &str) -> Option<&Bytes> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }

    /// The first header named `name`, if it is UTF-8.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        std::str::from_utf8(self.header_value(name)?).ok()
    }

    /// Whether the broker marked it redelivered.
    pub fn is_redelivered(&self) -> bool {
        self.redelivered
    }

    /// Whether it was re-driven from the dead-letter queue by hand.
    pub fn is_redriven(&self) -> bool {
        self.redriven
    }

    /// How many times the broker says it delivered it, if it counts.
    pub fn broker_delivery_count(&self) -> Option<u32> {
        self.delivery_count
    }

    /// The body, parsed as JSON into `T`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }

    /// The message's fingerprint: SHA-256 over the body. A redelivery has the
    /// same one; a different message under a known id does not
    /// (`message-id-reused`).
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::from_bytes(Sha256::digest(&self.body).into())
    }
}

impl fmt::Debug for Message {
    /// Never the body, never the whole id.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("id", &self.id.as_deref().map(Redacted::of))
            .field("body_len", &self.body.len())
            .field(
                "headers",
                &self.headers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("redelivered", &self.redelivered)
            .field("redriven", &self.redriven)
            .field("delivery_count", &self.delivery_count)
            .field("id_problem", &self.id_problem)
            .finish()
    }
}

/// One attempt at a message: what a [`Handler`](super::Handler) is given.
/// It derefs to the [`Message`].
///
/// The attempt number is counted durably by the inbox (a crash or a
/// redelivery does not reset it): 1 the first time, 2 after one failure, and
/// so on. The inbox keys it by its id ([`key`](Self::key)).
#[derive(Clone, Copy)]
pub struct Attempt<'a> {
    message: &'a Message,
    key: &'a str,
    number: u32,
}

impl<'a> Attempt<'a> {
    /// An attempt at `message`, keyed `key`, numbered `number`: inboxes build
    /// it for their handler.
    pub fn new(message: &'a Message, key: &'a str, number: u32) -> Self {
        Self {
            message,
            key,
            number,
        }
    }

    /// Which attempt this is: 1 for the first.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// The inbox's key of the message: its id, or (for an id too long to
    /// store, or none where the policy keys by body) `sha256:` and a hex
    /// digest. (The producer's id itself is the message's
    /// [`message_id`](Message::message_id).)
    pub fn key(&self) -> &'a str {
        self.key
    }

    /// The message.
    pub fn message(&self) -> &'a Message {
        self.message
    }
}

impl Deref for Attempt<'_> {
    type Target = Message;

    fn deref(&self) -> &Message {
        self.message
    }
}

impl fmt::Debug for Attempt<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attempt")
            .field("message_id", &Redacted::of(self.key))
            .field("number", &self.number)
            .field("message", self.message)
            .finish()
    }
}

/// The longest message id an inbox stores as it is; a longer one is keyed by
/// its digest.
pub const MAX_MESSAGE_ID_LEN: usize = 255;

/// The inbox's key for a message id: the id itself when it has 1 to
/// [`MAX_MESSAGE_ID_LEN`] bytes, no control character and does not begin
/// with `sha256:`; else `sha256:` and the hex digest of the id (a long id
/// still deduplicates). An id that begins with `sha256:` is digested too, so
/// that it never shares the key of the long id (or the body) it spells.
pub(crate) fn key_of_id(id: &str) -> String {
    if id.len() <= MAX_MESSAGE_ID_LEN
        && !id.chars().any(char::is_control)
        && !id.starts_with(DIGEST_PREFIX)
    {
        id.to_owned()
    } else {
        digest_key(id.as_bytes())
    }
}

/// What begins a digested key.
const DIGEST_PREFIX: &str = "sha256:";

/// `sha256:` and the hex digest of `bytes`.
pub(crate) fn digest_key(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut key = String::with_capacity(DIGEST_PREFIX.len() + 64);
    key.push_str(DIGEST_PREFIX);
    for byte in digest {
        let _ = write!(key, "{byte:02x}");
    }
    key
}

/// A message id's bytes as a listing shows them: the text when they are
/// UTF-8, else escaped (`\xff`), so that an id that could not be read is
/// still shown as it was sent.
///
/// ```
/// use idem_core::consume::id_text;
///
/// assert_eq!(id_text(b"pay-1"), "pay-1");
/// assert_eq!(id_text(&[b'p', 0xff]), "p\\xff");
/// ```
pub fn id_text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_owned(),
        Err(_) => bytes.escape_ascii().to_string(),
    }
}

/// `time` in RFC 3339, UTC, to the microsecond: how broker crates write a
/// dead letter's attempt times.
pub fn rfc3339(time: std::time::SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(time).to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// A time written in RFC 3339 ([`rfc3339`]); `None` when it is not one.
pub fn parse_rfc3339(text: &str) -> Option<std::time::SystemTime> {
    chrono::DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|time| std::time::SystemTime::from(time.with_timezone(&chrono::Utc)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_key_as_they_are_unless_too_long_or_controlled() {
        assert_eq!(key_of_id("m-1"), "m-1");
        assert_eq!(key_of_id("é-1"), "é-1");
        let long = "x".repeat(MAX_MESSAGE_ID_LEN + 1);
        let key = key_of_id(&long);
        assert!(key.starts_with("sha256:") && key.len() == 71, "{key}");
        assert_eq!(key, key_of_id(&long), "the same id keys the same");
        assert!(key_of_id("a\nb").starts_with("sha256:"));
        assert_eq!(Message::new("x").id("").message_id(), None);
        // An id that spells a long id's key is a key of its own.
        let spelled = key_of_id(&key);
        assert!(
            spelled.starts_with("sha256:") && spelled.len() == 71,
            "{spelled}"
        );
        assert_ne!(spelled, key);
    }

    #[test]
    fn debug_shows_neither_the_body_nor_the_whole_id() {
        let message = Message::new("secret-body").id("message-identifier");
        let shown = format!("{message:?}");
        assert!(!shown.contains("secret-body") && !shown.contains("message-identifier"));
        assert!(shown.contains("body_len: 11"), "{shown}");
    }
}
