//! A delivery translated into the protocol's [`Message`], and the headers
//! this crate writes on a message when it moves it.

use std::collections::BTreeMap;
use std::time::SystemTime;

use bytes::Bytes;
use idem_core::consume::{Message, rfc3339};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};

use crate::topology::{QueueType, string};

/// Why the message failed last (a string), on a retry's copy and on a dead
/// letter.
pub const REASON_HEADER: &str = "idem-reason";
/// When each failed attempt started (an array of RFC 3339 strings), on a
/// dead letter.
pub const ATTEMPTS_HEADER: &str = "idem-attempts";
/// The work queue the message failed in (a string), on a dead letter.
pub const QUEUE_HEADER: &str = "idem-queue";
/// Set (`true`) by a redrive: the consumer forgets the inbox's dead letter
/// before it processes the message ([`Message::redriven`]).
pub const REDRIVEN_HEADER: &str = "idem-redriven";
/// The names the headers above had before 0.1 (`x-idem-*`: the `x-` prefix
/// is deprecated, RFC 6648), still read on letters and re-driven messages
/// written then, and removed with the new ones.
const LEGACY: [(&str, &str); 4] = [
    (REASON_HEADER, "x-idem-reason"),
    (ATTEMPTS_HEADER, "x-idem-attempts"),
    (QUEUE_HEADER, "x-idem-queue"),
    (REDRIVEN_HEADER, "x-idem-redriven"),
];

/// The legacy name of `name`, one of this crate's headers.
fn legacy(name: &str) -> Option<&'static str> {
    LEGACY
        .iter()
        .find(|(current, _)| *current == name)
        .map(|(_, old)| *old)
}
/// The quorum queue's count of earlier deliveries of the message.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// AMQP's delivery mode for messages that survive a broker restart.
pub(crate) const PERSISTENT: u8 = 2;

/// A reason is cut to this many bytes in a header (a header table must fit
/// in one frame with the rest of the properties).
const MAX_REASON_LEN: usize = 4096;

/// The protocol's message for a delivery of `queue_type`: its `message_id`,
/// body, headers (strings, booleans and integers, as text; arrays and tables
/// left out), `redelivered`, the redrive marker, and a quorum queue's
/// delivery count (`x-delivery-count` plus one).
pub(crate) fn translate(
    properties: &BasicProperties,
    body: Vec<u8>,
    redelivered: bool,
    queue_type: QueueType,
) -> Message {
    let mut message = Message::new(Bytes::from(body)).redelivered(redelivered);
    if let Some(id) = properties.message_id() {
        message = message.id(id.as_str());
    }
    let mut earlier_deliveries = None;
    let mut redriven = false;
    if let Some(headers) = properties.headers() {
        for (name, value) in headers {
            match name.as_str() {
                REDRIVEN_HEADER | "x-idem-redriven" => redriven = truthy(value),
                DELIVERY_COUNT_HEADER => earlier_deliveries = integer(value),
                _ => {}
            }
            if let Some(text) = text(value) {
                message = message.header(name.as_str(), text);
            }
        }
    }
    if queue_type == QueueType::Quorum {
        let count = earlier_deliveries
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(0);
        message = message.delivery_count(count.saturating_add(1));
    }
    message.redriven(redriven)
}

/// The properties of a message's copy on its next hop (a retry, the
/// dead-letter queue): its own, with `reason` and, for a dead letter, the
/// work queue and the attempt times; persistent; no longer marked
/// re-driven nor carrying the quorum queue's count (the copy is a new
/// message to the broker).
pub(crate) fn hop(
    properties: &BasicProperties,
    queue: &str,
    reason: &str,
    attempts: Option<&[SystemTime]>,
) -> BasicProperties {
    let mut headers = headers(properties);
    remove(&mut headers, REDRIVEN_HEADER);
    headers.remove(DELIVERY_COUNT_HEADER);
    headers.insert(
        REASON_HEADER.into(),
        string(idem_core::log::cut(reason, MAX_REASON_LEN)),
    );
    if let Some(attempts) = attempts {
        headers.insert(QUEUE_HEADER.into(), string(queue));
        let times: Vec<AMQPValue> = attempts
            .iter()
            .map(|time| string(&rfc3339(*time)))
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

/// A dead letter's properties on its way back to the work queue: what this
/// crate wrote on it removed (its `x-death` history kept), marked
/// re-driven, persistent.
pub(crate) fn redriven(properties: &BasicProperties) -> BasicProperties {
    let mut headers = headers(properties);
    for name in [
        REASON_HEADER,
        ATTEMPTS_HEADER,
        QUEUE_HEADER,
        REDRIVEN_HEADER,
    ] {
        remove(&mut headers, name);
    }
    headers.remove(DELIVERY_COUNT_HEADER);
    headers.insert(REDRIVEN_HEADER.into(), AMQPValue::Boolean(true));
    properties
        .clone()
        .with_headers(FieldTable::from(headers))
        .with_delivery_mode(PERSISTENT)
}

/// Removes this crate's header `name`, under its name and its legacy one.
fn remove(headers: &mut BTreeMap<ShortString, AMQPValue>, name: &str) {
    headers.remove(name);
    if let Some(old) = legacy(name) {
        headers.remove(old);
    }
}

/// The header `name` (one of this crate's: under its legacy name too).
pub(crate) fn header<'p>(properties: &'p BasicProperties, name: &str) -> Option<&'p AMQPValue> {
    let headers = properties.headers().as_ref()?.inner();
    headers
        .get(name)
        .or_else(|| legacy(name).and_then(|old| headers.get(old)))
}

/// A string header.
pub(crate) fn string_header(properties: &BasicProperties, name: &str) -> Option<String> {
    match header(properties, name)? {
        AMQPValue::LongString(value) => Some(String::from_utf8_lossy(value.as_bytes()).into()),
        AMQPValue::ShortString(value) => Some(value.as_str().to_owned()),
        _ => None,
    }
}

/// The strings of an array header.
pub(crate) fn strings_header(properties: &BasicProperties, name: &str) -> Vec<String> {
    match header(properties, name) {
        Some(AMQPValue::FieldArray(values)) => {
            values.as_slice().iter().filter_map(as_string).collect()
        }
        _ => Vec::new(),
    }
}

pub(crate) fn as_string(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(value) => Some(String::from_utf8_lossy(value.as_bytes()).into()),
        AMQPValue::ShortString(value) => Some(value.as_str().to_owned()),
        _ => None,
    }
}

fn headers(properties: &BasicProperties) -> BTreeMap<ShortString, AMQPValue> {
    properties
        .headers()
        .as_ref()
        .map(|headers| headers.inner().clone())
        .unwrap_or_default()
}

/// A header's value as the protocol's bytes, when it has a plain one.
fn text(value: &AMQPValue) -> Option<Bytes> {
    match value {
        AMQPValue::LongString(value) => Some(Bytes::copy_from_slice(value.as_bytes())),
        AMQPValue::ShortString(value) => Some(Bytes::copy_from_slice(value.as_str().as_bytes())),
        AMQPValue::ByteArray(value) => Some(Bytes::copy_from_slice(value.as_slice())),
        AMQPValue::Boolean(value) => Some(Bytes::from(value.to_string())),
        other => integer(other).map(|n| Bytes::from(n.to_string())),
    }
}

pub(crate) fn integer(value: &AMQPValue) -> Option<i64> {
    Some(match *value {
        AMQPValue::ShortShortInt(n) => n.into(),
        AMQPValue::ShortShortUInt(n) => n.into(),
        AMQPValue::ShortInt(n) => n.into(),
        AMQPValue::ShortUInt(n) => n.into(),
        AMQPValue::LongInt(n) => n.into(),
        AMQPValue::LongUInt(n) => n.into(),
        AMQPValue::LongLongInt(n) => n,
        AMQPValue::Timestamp(n) => i64::try_from(n).ok()?,
        _ => return None,
    })
}

fn truthy(value: &AMQPValue) -> bool {
    match value {
        AMQPValue::Boolean(value) => *value,
        other => text(other).is_some_and(|text| text.as_ref() == b"true"),
    }
}

pub(crate) fn long_string(bytes: &[u8]) -> AMQPValue {
    AMQPValue::LongString(LongString::from(bytes.to_vec()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn with_headers(pairs: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (name, value) in pairs {
            table.insert((*name).into(), value.clone());
        }
        BasicProperties::default()
            .with_message_id("m-1".into())
            .with_headers(table)
    }

    #[test]
    fn a_delivery_becomes_the_protocols_message() {
        let properties = with_headers(&[
            (REDRIVEN_HEADER, AMQPValue::Boolean(true)),
            (DELIVERY_COUNT_HEADER, AMQPValue::LongLongInt(2)),
            ("tenant", string("acme")),
        ]);
        let message = translate(&properties, b"{}".to_vec(), true, QueueType::Quorum);
        assert_eq!(message.message_id(), Some("m-1"));
        assert!(message.is_redriven() && message.is_redelivered());
        assert_eq!(message.broker_delivery_count(), Some(3));
        assert_eq!(message.header_str("tenant"), Some("acme"));
        let first = translate(
            &BasicProperties::default(),
            Vec::new(),
            false,
            QueueType::Quorum,
        );
        assert_eq!(first.broker_delivery_count(), Some(1));
        assert!(!first.is_redriven());
        let classic = translate(&properties, Vec::new(), false, QueueType::Classic);
        assert_eq!(classic.broker_delivery_count(), None);
    }

    #[test]
    fn letters_written_with_the_old_x_idem_names_are_still_read_and_cleared() {
        let old = with_headers(&[
            ("x-idem-reason", string("a bug")),
            (
                "x-idem-attempts",
                AMQPValue::FieldArray(FieldArray::from(vec![string("2023-11-14T22:13:20Z")])),
            ),
            ("x-idem-queue", string("payments")),
            ("x-idem-redriven", AMQPValue::Boolean(true)),
        ]);
        assert_eq!(string_header(&old, REASON_HEADER).as_deref(), Some("a bug"));
        assert_eq!(
            string_header(&old, QUEUE_HEADER).as_deref(),
            Some("payments")
        );
        assert_eq!(strings_header(&old, ATTEMPTS_HEADER).len(), 1);
        assert!(translate(&old, Vec::new(), false, QueueType::Classic).is_redriven());
        let back = redriven(&old);
        for name in [
            "x-idem-reason",
            "x-idem-attempts",
            "x-idem-queue",
            "x-idem-redriven",
        ] {
            assert!(
                back.headers()
                    .as_ref()
                    .is_none_or(|h| !h.inner().contains_key(name)),
                "{name} kept"
            );
        }
        assert_eq!(
            header(&back, REDRIVEN_HEADER),
            Some(&AMQPValue::Boolean(true))
        );
        let again = hop(&old, "payments", "still a bug", None);
        assert_eq!(
            string_header(&again, REASON_HEADER).as_deref(),
            Some("still a bug")
        );
        assert!(header(&again, REDRIVEN_HEADER).is_none());
    }

    #[test]
    fn a_hop_writes_the_reason_and_times_and_drops_the_marker() {
        let properties = with_headers(&[
            (REDRIVEN_HEADER, AMQPValue::Boolean(true)),
            ("x-death", AMQPValue::FieldArray(FieldArray::default())),
        ]);
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_micros(1_700_000_000_123_456);
        let dead = hop(&properties, "payments", &"é".repeat(3000), Some(&[at]));
        assert!(header(&dead, REDRIVEN_HEADER).is_none());
        assert!(header(&dead, "x-death").is_some(), "the history is kept");
        assert!(string_header(&dead, REASON_HEADER).unwrap().len() <= MAX_REASON_LEN);
        let times = strings_header(&dead, ATTEMPTS_HEADER);
        assert_eq!(times, ["2023-11-14T22:13:20.123456Z"]);
        assert_eq!(idem_core::consume::parse_rfc3339(&times[0]), Some(at));
        assert_eq!(dead.delivery_mode(), &Some(PERSISTENT));
        let back = redriven(&dead);
        assert!(header(&back, REASON_HEADER).is_none());
        assert_eq!(
            header(&back, REDRIVEN_HEADER),
            Some(&AMQPValue::Boolean(true))
        );
    }
}
