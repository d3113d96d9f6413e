//! `dead-letters`: each dead letter as one JSON line.

use idem_rabbitmq::{DeadLetterMessage, rfc3339};
use serde::Serialize;
use serde_json::Value;

/// A dead letter as `dead-letters` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeadLetterLine {
    /// The work queue it failed in.
    pub queue: String,
    /// Its `message_id` (`null` when it had none: one reason to be here).
    pub message_id: Option<String>,
    /// When each failed attempt started, RFC 3339.
    pub attempts: Vec<String>,
    /// Why it is a dead letter.
    pub reason: String,
    /// The body: its JSON, or its text when it is not JSON.
    pub body: Value,
}

impl From<&DeadLetterMessage> for DeadLetterLine {
    fn from(letter: &DeadLetterMessage) -> Self {
        Self {
            queue: letter.queue.clone(),
            message_id: letter.message_id.clone(),
            attempts: letter.attempted_at.iter().copied().map(rfc3339).collect(),
            reason: letter.reason.clone(),
            body: serde_json::from_slice(&letter.body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&letter.body).into())),
        }
    }
}
