//! A payment message: its body, its key, and the headers the consumer writes
//! on it when it fails.

use std::collections::BTreeMap;
use std::time::SystemTime;

use chrono::{DateTime, SecondsFormat, Utc};
use idem_core::IdempotencyKey;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use serde::{Deserialize, Serialize};

/// Why the consumer last failed on the message (a string).
pub const REASON_HEADER: &str = "x-idem-reason";
/// When each failed attempt started (an array of RFC 3339 strings), written on
/// the message that goes to the dead-letter queue.
pub const ATTEMPTS_HEADER: &str = "x-idem-attempts";
/// The work queue the message failed in (a string).
pub const QUEUE_HEADER: &str = "x-idem-queue";
/// Set by `redrive`: the consumer lets the message through its inbox's dead
/// letters again before processing it.
pub const REDRIVEN_HEADER: &str = "x-idem-redriven";

/// The body of a message: add `amount` to the account's balance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payment {
    /// The account.
    pub account_id: String,
    /// The amount to add (negative: withdraw).
    pub amount: i64,
}

/// Why a message can never be processed: it goes to the dead-letter queue at
/// once.
#[derive(Debug, thiserror::Error)]
pub enum Permanent {
    /// No `message_id` property: a redelivery could not be told from a new
    /// message.
    #[error("the message has no message_id property: it cannot be processed exactly once")]
    NoMessageId,
    /// The `message_id` is not a usable key.
    #[error("the message_id is not a valid idempotency key: {0}")]
    InvalidMessageId(idem_core::KeyError),
    /// The body is not a payment.
    #[error("the body is not a payment {{\"account_id\": STRING, \"amount\": INT}}: {0}")]
    InvalidBody(serde_json::Error),
}

impl Permanent {
    /// A name for the log, which never carries the body.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NoMessageId => "no message_id",
            Self::InvalidMessageId(_) => "invalid message_id",
            Self::InvalidBody(_) => "invalid body",
        }
    }
}

/// The message's key (its `message_id`) and payment.
pub fn parse(
    properties: &BasicProperties,
    body: &[u8],
) -> Result<(IdempotencyKey, Payment), Permanent> {
    let id = properties
        .message_id()
        .as_ref()
        .ok_or(Permanent::NoMessageId)?;
    let key = IdempotencyKey::new(id.as_str()).map_err(Permanent::InvalidMessageId)?;
    let payment = serde_json::from_slice(body).map_err(Permanent::InvalidBody)?;
    Ok((key, payment))
}

/// Whether `redrive` sent the message back.
pub fn redriven(properties: &BasicProperties) -> bool {
    matches!(
        header(properties, REDRIVEN_HEADER),
        Some(AMQPValue::Boolean(true))
    )
}

/// A string header.
pub fn string_header(properties: &BasicProperties, name: &str) -> Option<String> {
    match header(properties, name)? {
        AMQPValue::LongString(value) => Some(String::from_utf8_lossy(value.as_bytes()).into()),
        AMQPValue::ShortString(value) => Some(value.as_str().to_owned()),
        _ => None,
    }
}

/// The attempt times written on a dead letter, as written (RFC 3339).
pub fn attempt_times(properties: &BasicProperties) -> Vec<String> {
    match header(properties, ATTEMPTS_HEADER) {
        Some(AMQPValue::FieldArray(times)) => times
            .as_slice()
            .iter()
            .filter_map(|time| match time {
                AMQPValue::LongString(value) => {
                    Some(String::from_utf8_lossy(value.as_bytes()).into_owned())
                }
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// `time` in RFC 3339, UTC, to the microsecond.
pub fn rfc3339(time: SystemTime) -> String {
    DateTime::<Utc>::from(time).to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// The message's properties for its next hop after a failure: its headers
/// (`x-death` among them) with the reason, the work queue and, when given,
/// the attempt times; persistent; no longer marked re-driven.
pub fn failed(
    properties: &BasicProperties,
    queue: &str,
    reason: &str,
    attempts: Option<&[SystemTime]>,
) -> BasicProperties {
    let mut headers = headers(properties);
    headers.remove(REDRIVEN_HEADER);
    headers.insert(REASON_HEADER.into(), long_string(reason));
    headers.insert(QUEUE_HEADER.into(), long_string(queue));
    if let Some(attempts) = attempts {
        let times: Vec<AMQPValue> = attempts
            .iter()
            .map(|time| long_string(&rfc3339(*time)))
            .collect();
        headers.insert(
            ATTEMPTS_HEADER.into(),
            AMQPValue::FieldArray(FieldArray::from(times)),
        );
    }
    properties
        .clone()
        .with_headers(FieldTable::from(headers))
        .with_delivery_mode(PERSISTENT)
}

/// A dead letter's properties for its way back to the work queue: what the
/// consumer wrote on it removed (its `x-death` history kept), marked
/// re-driven.
pub fn redriven_properties(properties: &BasicProperties) -> BasicProperties {
    let mut headers = headers(properties);
    for name in [REASON_HEADER, ATTEMPTS_HEADER, QUEUE_HEADER] {
        headers.remove(name);
    }
    headers.insert(REDRIVEN_HEADER.into(), AMQPValue::Boolean(true));
    properties
        .clone()
        .with_headers(FieldTable::from(headers))
        .with_delivery_mode(PERSISTENT)
}

/// AMQP's delivery mode for messages that survive a broker restart.
pub const PERSISTENT: u8 = 2;

fn header<'p>(properties: &'p BasicProperties, name: &str) -> Option<&'p AMQPValue> {
    properties.headers().as_ref()?.inner().get(name)
}

fn headers(properties: &BasicProperties) -> BTreeMap<ShortString, AMQPValue> {
    properties
        .headers()
        .as_ref()
        .map(|headers| headers.inner().clone())
        .unwrap_or_default()
}

fn long_string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}
