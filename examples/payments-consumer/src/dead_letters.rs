//! `dead-letters`: each dead letter as one JSON line.

use idem_rabbitmq::{DeadLetterMessage, rfc3339};
use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

/// A dead letter as `dead-letters` prints it.
#[derive(Clone, Debug, Serialize)]
pub struct DeadLetterLine {
    /// Where it failed: `"queue"` (RabbitMQ, SQS) or `"topic"` (Kafka).
    #[serde(flatten)]
    pub source: Source,
    /// Its `message_id` (`null` when it had none: one reason to be here).
    pub message_id: Option<String>,
    /// When each failed attempt started, RFC 3339.
    pub attempts: Vec<String>,
    /// Why it is a dead letter.
    pub reason: String,
    /// The body as it was sent: its JSON, byte for byte (key order and
    /// duplicate keys kept), or a JSON string of its text when it is not
    /// JSON.
    pub body: Box<RawValue>,
    /// Set when the body was cut to fit the dead-letter topic (Kafka): its
    /// size in bytes before the cut. Absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub truncated: Option<u64>,
}

/// Where a dead letter failed, as its line names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Source {
    /// A queue (RabbitMQ's work queue, SQS's source queue): `"queue"`.
    #[serde(rename = "queue")]
    Queue(String),
    /// A Kafka topic: `"topic"`.
    #[serde(rename = "topic")]
    Topic(String),
}

impl DeadLetterLine {
    /// The line of a dead letter from `source`, its body shown as JSON, or as
    /// text when it is not JSON.
    pub fn new(
        source: Source,
        message_id: Option<String>,
        attempted_at: &[std::time::SystemTime],
        reason: String,
        body: &[u8],
    ) -> Self {
        Self {
            source,
            message_id,
            attempts: attempted_at.iter().copied().map(rfc3339).collect(),
            reason,
            body: as_sent(body),
            truncated: None,
        }
    }

    /// The same line, of a letter whose body was cut from `size` bytes.
    #[must_use]
    pub fn truncated(mut self, size: Option<u64>) -> Self {
        self.truncated = size;
        self
    }
}

/// A body as it was sent: its JSON when it is JSON, else its text as a JSON
/// string.
fn as_sent(body: &[u8]) -> Box<RawValue> {
    std::str::from_utf8(body)
        .ok()
        .and_then(|text| RawValue::from_string(text.trim().to_owned()).ok())
        .unwrap_or_else(|| {
            let text = Value::String(String::from_utf8_lossy(body).into_owned());
            // A string always serializes: the default (`null`) is never used.
            serde_json::value::to_raw_value(&text).unwrap_or_default()
        })
}

impl From<&DeadLetterMessage> for DeadLetterLine {
    fn from(letter: &DeadLetterMessage) -> Self {
        Self::new(
            Source::Queue(letter.queue.clone()),
            letter.message_id.clone(),
            &letter.attempted_at,
            letter.reason.clone(),
            &letter.body,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_is_shown_as_it_was_sent() {
        let line = |body: &[u8]| {
            let letter = DeadLetterLine::new(
                Source::Topic("payments".to_owned()),
                None,
                &[],
                "reason".to_owned(),
                body,
            );
            serde_json::to_string(&letter.body).unwrap_or_default()
        };
        // Key order and a duplicate key kept, byte for byte.
        assert_eq!(
            line(br#"{"amount": 5, "account_id": "a", "amount": 7}"#),
            r#"{"amount": 5, "account_id": "a", "amount": 7}"#
        );
        assert_eq!(line(b"not json"), r#""not json""#);
        assert_eq!(line(&[b'x', 0xff]), "\"x\u{fffd}\"");
    }
}
