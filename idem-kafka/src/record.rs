//! Records as the protocol sees them, and the headers of dead letters.

use idem_core::consume::{AMBIGUOUS_MESSAGE_ID, Letter, Message, UNREADABLE_MESSAGE_ID, rfc3339};
use rdkafka::Message as _;
use rdkafka::message::{Header, Headers, OwnedHeaders, OwnedMessage};

/// The record header that carries a message's idempotency key (UTF-8).
pub const MESSAGE_ID_HEADER: &str = "message_id";
/// A dead letter's reason.
pub const REASON_HEADER: &str = "idem-reason";
/// A dead letter's attempts: their times, RFC 3339, comma-separated.
pub const ATTEMPTS_HEADER: &str = "idem-attempts";
/// The topic a dead letter failed in.
pub const TOPIC_HEADER: &str = "idem-topic";
/// The partition a dead letter failed in.
pub const PARTITION_HEADER: &str = "idem-partition";
/// A dead letter's offset in its partition.
pub const OFFSET_HEADER: &str = "idem-offset";
/// Set on a dead letter whose value was cut to fit the dead-letter topic: the
/// value's size in bytes before the cut. Such a letter is never re-driven.
pub const TRUNCATED_HEADER: &str = "idem-body-truncated";
/// Set on a record re-driven from the dead-letter topic: its dead letter is
/// forgotten, and it runs again from attempt 1.
pub const REDRIVEN_HEADER: &str = "idem-redriven";

/// Whether `name` is one of the headers this crate writes on a dead letter or
/// a re-driven record (they are not carried over).
pub(crate) fn is_own_header(name: &str) -> bool {
    matches!(
        name,
        REASON_HEADER
            | ATTEMPTS_HEADER
            | TOPIC_HEADER
            | PARTITION_HEADER
            | OFFSET_HEADER
            | REDRIVEN_HEADER
            | TRUNCATED_HEADER
    ) || name == crate::dead_letters::REDRIVEN_THROUGH_HEADER
}

/// The protocol's message for a record: its value, its headers, its id from
/// the `message_id` header. A value that is not UTF-8, or two `message_id`
/// headers that differ, is an id that cannot be read: the record is
/// dead-lettered at once with the reason `unreadable-message-id` or
/// `ambiguous-message-id`.
pub(crate) fn message_of(record: &OwnedMessage) -> Message {
    let mut message = Message::new(bytes::Bytes::copy_from_slice(
        record.payload().unwrap_or_default(),
    ));
    let mut id: Option<&[u8]> = None;
    if let Some(headers) = record.headers() {
        for header in headers.iter() {
            let value = header.value.unwrap_or_default();
            if header.key == MESSAGE_ID_HEADER {
                match id {
                    Some(first) if first != value => {
                        message = message.id_problem(AMBIGUOUS_MESSAGE_ID);
                    }
                    Some(_) => {}
                    None => {
                        id = Some(value);
                        match std::str::from_utf8(value) {
                            Ok(text) => message = message.id(text),
                            Err(_) => message = message.id_problem(UNREADABLE_MESSAGE_ID),
                        }
                    }
                }
            }
            if header.key == REDRIVEN_HEADER {
                message = message.redriven(value == b"true");
            }
            message = message.header(header.key, bytes::Bytes::copy_from_slice(value));
        }
    }
    message
}

/// The headers of a record's dead letter: its own (but this crate's), then
/// the reason, the attempts' times, and where it failed; and, when its value
/// was cut to fit, the value's size before the cut.
pub(crate) fn dead_letter_headers(
    record: &OwnedMessage,
    letter: &Letter,
    truncated: Option<usize>,
) -> OwnedHeaders {
    let mut headers = carried_headers(record);
    if let Some(size) = truncated {
        headers = headers.insert(Header {
            key: TRUNCATED_HEADER,
            value: Some(size.to_string().as_str()),
        });
    }
    let attempts: Vec<String> = letter.attempted_at.iter().copied().map(rfc3339).collect();
    let partition = record.partition().to_string();
    let offset = record.offset().to_string();
    for (key, value) in [
        (REASON_HEADER, letter.reason.as_str()),
        (ATTEMPTS_HEADER, attempts.join(",").as_str()),
        (TOPIC_HEADER, record.topic()),
        (PARTITION_HEADER, partition.as_str()),
        (OFFSET_HEADER, offset.as_str()),
    ] {
        headers = headers.insert(Header {
            key,
            value: Some(value),
        });
    }
    headers
}

/// A record's headers but this crate's.
pub(crate) fn carried_headers(record: &OwnedMessage) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new();
    if let Some(own) = record.headers() {
        for header in own.iter().filter(|h| !is_own_header(h.key)) {
            headers = headers.insert(Header {
                key: header.key,
                value: header.value,
            });
        }
    }
    headers
}

/// The header `name` of `record`, as text.
pub(crate) fn header_str<'r>(record: &'r OwnedMessage, name: &str) -> Option<&'r str> {
    record
        .headers()?
        .iter()
        .find(|header| header.key == name)
        .and_then(|header| std::str::from_utf8(header.value?).ok())
}

#[cfg(test)]
mod tests {
    use rdkafka::Timestamp;

    use super::*;

    fn record(ids: &[&[u8]]) -> OwnedMessage {
        let mut headers = OwnedHeaders::new();
        for id in ids {
            headers = headers.insert(Header {
                key: MESSAGE_ID_HEADER,
                value: Some(*id),
            });
        }
        OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "payments".to_owned(),
            Timestamp::NotAvailable,
            0,
            7,
            Some(headers),
        )
    }

    #[test]
    fn an_id_is_read_once_and_an_unreadable_or_ambiguous_one_is_said_so() {
        let read = |ids: &[&[u8]]| {
            let message = message_of(&record(ids));
            (
                message.message_id().map(str::to_owned),
                message.get_id_problem(),
            )
        };
        assert_eq!(read(&[b"m-1"]), (Some("m-1".to_owned()), None));
        assert_eq!(read(&[b"m-1", b"m-1"]), (Some("m-1".to_owned()), None));
        assert_eq!(read(&[]), (None, None));
        assert_eq!(read(&[&[0xff, 0xfe]]).1, Some(UNREADABLE_MESSAGE_ID));
        assert_eq!(read(&[b"m-1", b"m-2"]).1, Some(AMBIGUOUS_MESSAGE_ID));
    }
}
