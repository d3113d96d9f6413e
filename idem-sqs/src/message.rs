//! A received SQS message translated into the protocol's [`Message`], and
//! the message attributes this crate writes when it moves one.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::SystemTime;

use aws_sdk_sqs::types::{self as sqs, MessageAttributeValue, MessageSystemAttributeName};
use bytes::Bytes;
use idem_core::consume::{Message, UNREADABLE_MESSAGE_ID, parse_rfc3339, rfc3339};
use sha2::{Digest, Sha256};

/// The message attribute a producer sets to the message's idempotency key.
pub const MESSAGE_ID_ATTRIBUTE: &str = "message_id";
/// Why the message is a dead letter (a string), on a dead letter.
pub const REASON_ATTRIBUTE: &str = "idem-reason";
/// When each failed attempt started (RFC 3339 times, comma-separated), on a
/// dead letter.
pub const ATTEMPTS_ATTRIBUTE: &str = "idem-attempts";
/// The name of the queue the message failed in, on a dead letter.
pub const QUEUE_ATTRIBUTE: &str = "idem-queue";
/// A FIFO message's group in the queue it failed in, on a dead letter (in
/// the dead-letter queue each letter is a group of its own, so that one can
/// be listed or moved without the others).
pub const GROUP_ATTRIBUTE: &str = "idem-group";
/// Set (`true`) by a redrive: the consumer forgets the inbox's dead letter
/// before it processes the message ([`Message::redriven`]).
pub const REDRIVEN_ATTRIBUTE: &str = "idem-redriven";

/// The most message attributes SQS takes on one message.
pub(crate) const MAX_ATTRIBUTES: usize = 10;
/// A reason is cut to this many bytes in its attribute.
const MAX_REASON_LEN: usize = 1024;

/// What this crate writes on a dead letter, removed again by a redrive.
const OWN_ATTRIBUTES: [&str; 5] = [
    REASON_ATTRIBUTE,
    ATTEMPTS_ATTRIBUTE,
    QUEUE_ATTRIBUTE,
    GROUP_ATTRIBUTE,
    REDRIVEN_ATTRIBUTE,
];

/// A received message: the protocol's message, and what the consumer needs
/// to settle it on SQS.
#[derive(Clone, Debug)]
pub(crate) struct Received {
    pub(crate) message: Message,
    pub(crate) receipt: String,
    /// The FIFO message group.
    pub(crate) group: Option<String>,
    /// The message as SQS gave it (its attributes are copied on a move).
    pub(crate) raw: sqs::Message,
}

/// The idempotency key SQS gives `message`: its `message_id` attribute when
/// present (String or Number: its text; Binary: its bytes, which must be
/// UTF-8), else its FIFO `MessageDeduplicationId`, else its SQS `MessageId`.
///
/// An attribute that is present but unreadable (Binary bytes that are not
/// UTF-8, or empty) gives no key at all, so the message is dead-lettered
/// with the reason `unreadable-message-id`: falling back to the SQS `MessageId`,
/// which a producer's resend does not keep, would apply a resend twice.
pub(crate) fn message_id(message: &sqs::Message) -> Option<&str> {
    let attribute = message
        .message_attributes()
        .and_then(|attributes| attributes.get(MESSAGE_ID_ATTRIBUTE));
    match attribute {
        Some(attribute) => attribute.string_value().or_else(|| {
            attribute
                .binary_value()
                .and_then(|bytes| std::str::from_utf8(bytes.as_ref()).ok())
        }),
        None => system_attribute(message, MessageSystemAttributeName::MessageDeduplicationId)
            .or_else(|| message.message_id()),
    }
    .filter(|id| !id.is_empty())
}

/// The protocol's message for `message`, or `None` when SQS gave no receipt
/// handle (it cannot be settled).
pub(crate) fn translate(message: sqs::Message) -> Option<Received> {
    let receipt = message.receipt_handle()?.to_owned();
    let body = Bytes::copy_from_slice(message.body().unwrap_or_default().as_bytes());
    let mut translated = Message::new(body);
    match message_id(&message) {
        Some(id) => translated = translated.id(id),
        // The attribute is there but unreadable: dead-lettered with why.
        None if message
            .message_attributes()
            .is_some_and(|attributes| attributes.contains_key(MESSAGE_ID_ATTRIBUTE)) =>
        {
            translated = translated.id_problem(UNREADABLE_MESSAGE_ID);
        }
        None => {}
    }
    if let Some(attributes) = message.message_attributes() {
        for (name, value) in attributes {
            if let Some(text) = value.string_value() {
                translated =
                    translated.header(name.as_str(), Bytes::copy_from_slice(text.as_bytes()));
            } else if let Some(binary) = value.binary_value() {
                translated =
                    translated.header(name.as_str(), Bytes::copy_from_slice(binary.as_ref()));
            }
        }
    }
    if let Some(count) = system_attribute(
        &message,
        MessageSystemAttributeName::ApproximateReceiveCount,
    )
    .and_then(|count| count.parse::<u32>().ok())
    {
        translated = translated.delivery_count(count);
    }
    let redriven = string_attribute(&message, REDRIVEN_ATTRIBUTE) == Some("true");
    let group =
        system_attribute(&message, MessageSystemAttributeName::MessageGroupId).map(str::to_owned);
    Some(Received {
        message: translated.redriven(redriven),
        receipt,
        group,
        raw: message,
    })
}

/// The string message attribute `name`.
pub(crate) fn string_attribute<'m>(message: &'m sqs::Message, name: &str) -> Option<&'m str> {
    message.message_attributes()?.get(name)?.string_value()
}

/// The system attribute `name`.
pub(crate) fn system_attribute(
    message: &sqs::Message,
    name: MessageSystemAttributeName,
) -> Option<&str> {
    message.attributes()?.get(&name).map(String::as_str)
}

/// A string message attribute (`None` only if the SDK's builder refused
/// it, which it does not with a data type set).
pub(crate) fn string(value: &str) -> Option<MessageAttributeValue> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .ok()
}

/// Sets the string attribute `name`.
fn put(attributes: &mut HashMap<String, MessageAttributeValue>, name: &str, value: &str) {
    if let Some(value) = string(value) {
        attributes.insert(name.to_owned(), value);
    }
}

/// The attributes of a dead letter's copy: the message's id (so that a
/// redrive keeps its key), the reason, the attempts' times, the queue and
/// the FIFO group, then the message's own attributes while SQS's limit of
/// [`MAX_ATTRIBUTES`] allows.
pub(crate) fn dead_letter_attributes(
    received: &Received,
    queue: &str,
    reason: &str,
    attempted_at: &[SystemTime],
) -> HashMap<String, MessageAttributeValue> {
    let mut attributes = HashMap::new();
    if let Some(id) = received.message.message_id() {
        put(&mut attributes, MESSAGE_ID_ATTRIBUTE, id);
    }
    let reason = idem_core::log::cut(reason, MAX_REASON_LEN);
    put(
        &mut attributes,
        REASON_ATTRIBUTE,
        if reason.is_empty() { "unknown" } else { reason },
    );
    if !attempted_at.is_empty() {
        let times: Vec<String> = attempted_at.iter().copied().map(rfc3339).collect();
        put(&mut attributes, ATTEMPTS_ATTRIBUTE, &times.join(","));
    }
    put(&mut attributes, QUEUE_ATTRIBUTE, queue);
    if let Some(group) = &received.group {
        put(&mut attributes, GROUP_ATTRIBUTE, group);
    }
    copy_own(&received.raw, &mut attributes);
    attributes
}

/// The attributes of a dead letter on its way back: what this crate wrote
/// removed, marked re-driven.
pub(crate) fn redriven_attributes(letter: &sqs::Message) -> HashMap<String, MessageAttributeValue> {
    let mut attributes = HashMap::new();
    put(&mut attributes, REDRIVEN_ATTRIBUTE, "true");
    if let Some(id) = message_id(letter) {
        put(&mut attributes, MESSAGE_ID_ATTRIBUTE, id);
    }
    copy_own(letter, &mut attributes);
    attributes
}

/// Copies `message`'s attributes, except this crate's, into `attributes`
/// while there is room.
fn copy_own(message: &sqs::Message, attributes: &mut HashMap<String, MessageAttributeValue>) {
    let Some(own) = message.message_attributes() else {
        return;
    };
    let mut names: Vec<&String> = own.keys().collect();
    names.sort();
    for name in names {
        if attributes.len() >= MAX_ATTRIBUTES {
            tracing::warn!(attribute = %name, "a message attribute is left off the copy: SQS takes 10 at most");
            continue;
        }
        if OWN_ATTRIBUTES.contains(&name.as_str()) || attributes.contains_key(name) {
            continue;
        }
        if let Some(value) = own.get(name) {
            attributes.insert(name.clone(), value.clone());
        }
    }
}

/// The times of an `idem-attempts` attribute.
pub(crate) fn parse_attempts(text: &str) -> Vec<SystemTime> {
    text.split(',')
        .filter_map(|time| parse_rfc3339(time.trim()))
        .collect()
}

/// The hex SHA-256 of `parts`, each length-prefixed (a deduplication id:
/// 64 characters, under SQS's 128).
pub(crate) fn digest(parts: &[&[u8]]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    let mut hex = String::with_capacity(64);
    for byte in hasher.finalize() {
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

/// The hex SHA-256 of `body`'s canonical content: a JSON body with its
/// object keys sorted and no insignificant whitespace (so `{"a":1, "b":2}`
/// and `{"b":2,"a":1}` are one content), any other body as its bytes.
pub fn content_digest(body: &str) -> String {
    let canonical = match serde_json::from_str::<serde_json::Value>(body) {
        Ok(value) => {
            let mut out = String::with_capacity(body.len());
            canonical_json(&value, &mut out);
            out
        }
        Err(_) => body.to_owned(),
    };
    let mut hex = String::with_capacity(64);
    for byte in Sha256::digest(canonical.as_bytes()) {
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

fn canonical_json(value: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                canonical_json(value, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_content_digest_ignores_key_order_and_whitespace_only() {
        let a = content_digest(r#"{"account_id": "acc_1", "amount": 5}"#);
        let b = content_digest(r#"{"amount":5,"account_id":"acc_1"}"#);
        let c = content_digest(r#"{"amount":6,"account_id":"acc_1"}"#);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 64);
        assert_ne!(content_digest("not json"), content_digest("not  json"));
    }

    #[test]
    fn the_key_is_the_attribute_then_the_dedup_id_then_the_sqs_id() {
        let with = |attribute: Option<&str>, dedup: Option<&str>| {
            let mut message = sqs::Message::builder()
                .message_id("sqs-id")
                .receipt_handle("r");
            if let Some(id) = attribute {
                message = message.set_message_attributes(Some(HashMap::from([(
                    MESSAGE_ID_ATTRIBUTE.to_owned(),
                    string(id).unwrap_or_else(|| unreachable!()),
                )])));
            }
            if let Some(dedup) = dedup {
                message =
                    message.attributes(MessageSystemAttributeName::MessageDeduplicationId, dedup);
            }
            message.build()
        };
        assert_eq!(message_id(&with(Some("m-1"), Some("d"))), Some("m-1"));
        assert_eq!(message_id(&with(None, Some("d"))), Some("d"));
        assert_eq!(message_id(&with(None, None)), Some("sqs-id"));
    }

    #[test]
    fn a_binary_id_is_its_utf8_bytes_and_an_unreadable_one_is_no_id() {
        let with = |value: MessageAttributeValue| {
            sqs::Message::builder()
                .message_id("sqs-id")
                .receipt_handle("r")
                .set_message_attributes(Some(HashMap::from([(
                    MESSAGE_ID_ATTRIBUTE.to_owned(),
                    value,
                )])))
                .build()
        };
        let binary = |bytes: &[u8]| {
            MessageAttributeValue::builder()
                .data_type("Binary")
                .binary_value(aws_sdk_sqs::primitives::Blob::new(bytes))
                .build()
                .unwrap_or_else(|_| unreachable!())
        };
        let number = MessageAttributeValue::builder()
            .data_type("Number")
            .string_value("42")
            .build()
            .unwrap_or_else(|_| unreachable!());
        assert_eq!(message_id(&with(binary(b"pay-7"))), Some("pay-7"));
        assert_eq!(message_id(&with(number)), Some("42"));
        assert_eq!(message_id(&with(binary(&[0xff, 0xfe]))), None);
        assert_eq!(message_id(&with(binary(b""))), None);
        let translated = translate(with(binary(b"pay-7"))).unwrap_or_else(|| unreachable!());
        assert_eq!(translated.message.message_id(), Some("pay-7"));
        let unreadable = translate(with(binary(&[0xff]))).unwrap_or_else(|| unreachable!());
        assert_eq!(
            unreadable.message.get_id_problem(),
            Some(UNREADABLE_MESSAGE_ID)
        );
    }

    #[test]
    fn attempts_round_trip_and_reasons_are_cut_on_a_boundary() {
        let times = [SystemTime::UNIX_EPOCH, SystemTime::now()];
        let text: Vec<String> = times.iter().copied().map(rfc3339).collect();
        let parsed = parse_attempts(&text.join(","));
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0], SystemTime::UNIX_EPOCH);
        assert_eq!(idem_core::log::cut("éé", 3), "é");
    }
}
