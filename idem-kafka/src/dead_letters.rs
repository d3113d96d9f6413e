//! The dead-letter topic, read without consuming it, and re-driven by hand.
//!
//! A dead letter is a record of `<topic>.dlq`: the failed record's key, value
//! and headers (`message_id` among them), with its reason, its attempts'
//! times and where it failed ([`REASON_HEADER`](crate::REASON_HEADER)…).
//! Reading the topic changes nothing. A redrive republishes each dead letter
//! to its topic marked re-driven ([`REDRIVEN_HEADER`](crate::REDRIVEN_HEADER):
//! the consumer forgets its dead letter and runs it from attempt 1), then
//! appends a mark to the dead-letter topic, a record with no value and the
//! header [`REDRIVEN_THROUGH_HEADER`], saying how far it went. Listings and
//! later redrives skip what a mark covers, so a second redrive republishes
//! nothing. A redrive cut off before its mark republishes its letters again
//! next time; the consumer's inbox applies each once all the same.
//!
//! A letter whose value was cut to fit the topic
//! ([`TRUNCATED_HEADER`](crate::TRUNCATED_HEADER)) is never republished: its
//! value is not the record's. It stays listed, and every redrive names it
//! ([`Redrive::kept`]); the whole record is in its own topic until the
//! topic's retention drops it.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idem_core::consume::{id_text, parse_rfc3339};
use rdkafka::ClientConfig;
use rdkafka::Message as _;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Headers as _;
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::FutureRecord;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use crate::error::Error;
use crate::record::{
    ATTEMPTS_HEADER, MESSAGE_ID_HEADER, REASON_HEADER, REDRIVEN_HEADER, TOPIC_HEADER,
    TRUNCATED_HEADER, carried_headers, header_str,
};
use crate::topics::{self, dead_letter_topic};

/// The header of a redrive's mark: `PARTITION:OFFSET` pairs, comma-separated,
/// each the dead-letter topic's partition and the offset the redrive reached
/// (excluded).
pub const REDRIVEN_THROUGH_HEADER: &str = "idem-redriven-through";

/// How long a read of the dead-letter topic may take.
const READ_LIMIT: Duration = Duration::from_secs(60);

/// A dead letter, as the dead-letter topic holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterRecord {
    /// The topic it failed in.
    pub topic: String,
    /// Its `message_id` header (`None` when it had none: one reason to be
    /// here); escaped (`\xff`) when it is not UTF-8.
    pub message_id: Option<String>,
    /// When each failed attempt started.
    pub attempted_at: Vec<SystemTime>,
    /// Why it is a dead letter.
    pub reason: String,
    /// Its value (cut to fit when `truncated` is set).
    pub body: Bytes,
    /// The value's size in bytes before it was cut to fit the dead-letter
    /// topic; `None` when `body` is the whole value.
    pub truncated: Option<u64>,
    /// Its partition in the dead-letter topic.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
}

/// The dead letters of `topic` (in `<topic>.dlq`) not re-driven yet, oldest
/// first; nothing is consumed.
pub async fn dead_letters(servers: &str, topic: &str) -> Result<Vec<DeadLetterRecord>, Error> {
    let letters = read(servers, &dead_letter_topic(topic)).await?;
    Ok(letters
        .pending
        .iter()
        .map(|record| letter_of(topic, record))
        .collect())
}

/// What a [`redrive`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Redrive {
    /// How many dead letters it republished.
    pub republished: usize,
    /// The letters it did not republish because their value was cut to fit
    /// the dead-letter topic: they stay listed.
    pub kept: Vec<DeadLetterRecord>,
}

/// Republishes to `topic` every dead letter of `<topic>.dlq` not re-driven
/// before, marked re-driven, waiting for the broker's acknowledgements; then
/// marks them re-driven in the dead-letter topic. A letter cut to fit is not
/// republished: it is named in [`Redrive::kept`].
pub async fn redrive(servers: &str, topic: &str) -> Result<Redrive, Error> {
    let dlq = dead_letter_topic(topic);
    let letters = read(servers, &dlq).await?;
    let (kept, whole): (Vec<&OwnedMessage>, Vec<&OwnedMessage>) = letters
        .pending
        .iter()
        .partition(|record| header_str(record, TRUNCATED_HEADER).is_some());
    let kept: Vec<DeadLetterRecord> = kept
        .into_iter()
        .map(|record| letter_of(topic, record))
        .collect();
    if whole.is_empty() {
        return Ok(Redrive {
            republished: 0,
            kept,
        });
    }
    let producer = topics::producer(servers)?;
    for record in &whole {
        let headers = carried_headers(record).insert(Header {
            key: REDRIVEN_HEADER,
            value: Some("true"),
        });
        let mut again = FutureRecord::to(topic)
            .payload(record.payload().unwrap_or_default())
            .headers(headers);
        if let Some(key) = record.key() {
            again = again.key(key);
        }
        producer
            .send(again, Duration::from_secs(30))
            .await
            .map_err(|(error, _)| Error::kafka("republish a dead letter")(error))?;
    }
    let through: Vec<String> = letters
        .ends
        .iter()
        .map(|(partition, end)| format!("{partition}:{end}"))
        .collect();
    let mark = FutureRecord::<(), ()>::to(&dlq)
        .partition(0)
        .headers(OwnedHeaders::new().insert(Header {
            key: REDRIVEN_THROUGH_HEADER,
            value: Some(through.join(",").as_str()),
        }));
    producer
        .send(mark, Duration::from_secs(30))
        .await
        .map_err(|(error, _)| Error::kafka("mark the dead letters re-driven")(error))?;
    tracing::info!(target: "idem_kafka", count = whole.len(), kept = kept.len(), "dead letters re-driven");
    Ok(Redrive {
        republished: whole.len(),
        kept,
    })
}

/// What the dead-letter topic holds.
struct Letters {
    /// The dead letters no mark covers, oldest first.
    pending: Vec<OwnedMessage>,
    /// Each partition's end when read.
    ends: Vec<(i32, i64)>,
}

/// Reads the whole dead-letter topic, up to each partition's end as it was
/// when the read began.
async fn read(servers: &str, dlq: &str) -> Result<Letters, Error> {
    let (servers, dlq) = (servers.to_owned(), dlq.to_owned());
    tokio::task::spawn_blocking(move || read_blocking(&servers, &dlq))
        .await
        .map_err(|_| Error::TimedOut("the dead-letter topic"))?
}

fn read_blocking(servers: &str, dlq: &str) -> Result<Letters, Error> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("group.id", format!("idem-kafka-dead-letters-{dlq}"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .map_err(Error::kafka("create a reader"))?;
    let metadata = consumer
        .fetch_metadata(Some(dlq), Duration::from_secs(30))
        .map_err(Error::kafka("read the dead-letter topic's metadata"))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == dlq)
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    let mut tpl = TopicPartitionList::new();
    let mut ends = Vec::new();
    let mut left = 0;
    for &partition in &partitions {
        let (low, high) = consumer
            .fetch_watermarks(dlq, partition, Duration::from_secs(30))
            .map_err(Error::kafka("read the dead-letter topic's ends"))?;
        ends.push((partition, high));
        if high > low {
            tpl.add_partition_offset(dlq, partition, Offset::Offset(low))
                .map_err(Error::kafka("read the dead-letter topic"))?;
            left += 1;
        }
    }
    let mut records = Vec::new();
    if left > 0 {
        consumer
            .assign(&tpl)
            .map_err(Error::kafka("read the dead-letter topic"))?;
        let end_of: HashMap<i32, i64> = ends.iter().copied().collect();
        let mut done: HashMap<i32, bool> = HashMap::new();
        let deadline = std::time::Instant::now() + READ_LIMIT;
        while done.len() < left {
            if std::time::Instant::now() > deadline {
                return Err(Error::TimedOut("the dead-letter topic"));
            }
            match consumer.poll(Duration::from_millis(200)) {
                None => {}
                Some(Err(error)) => return Err(Error::kafka("read the dead-letter topic")(error)),
                Some(Ok(record)) => {
                    let partition = record.partition();
                    let end = end_of.get(&partition).copied().unwrap_or(0);
                    if record.offset() < end {
                        records.push(record.detach());
                    }
                    if record.offset() + 1 >= end {
                        done.insert(partition, true);
                    }
                }
            }
        }
    }
    // The marks: how far each partition was re-driven.
    let mut through: HashMap<i32, i64> = HashMap::new();
    for record in &records {
        if let Some(marks) = header_str(record, REDRIVEN_THROUGH_HEADER) {
            for (partition, end) in marks.split(',').filter_map(|m| m.split_once(':')) {
                if let (Ok(partition), Ok(end)) = (partition.parse::<i32>(), end.parse::<i64>()) {
                    let reached = through.entry(partition).or_insert(end);
                    *reached = (*reached).max(end);
                }
            }
        }
    }
    // A letter cut to fit is never re-driven, so no mark covers it.
    let mut pending: Vec<OwnedMessage> = records
        .into_iter()
        .filter(|record| header_str(record, REDRIVEN_THROUGH_HEADER).is_none())
        .filter(|record| {
            header_str(record, TRUNCATED_HEADER).is_some()
                || through
                    .get(&record.partition())
                    .is_none_or(|&end| record.offset() >= end)
        })
        .collect();
    pending.sort_by_key(|record| {
        (
            record.timestamp().to_millis(),
            record.partition(),
            record.offset(),
        )
    });
    Ok(Letters { pending, ends })
}

/// A dead letter's record as the listing shows it.
fn letter_of(topic: &str, record: &OwnedMessage) -> DeadLetterRecord {
    DeadLetterRecord {
        topic: header_str(record, TOPIC_HEADER).unwrap_or(topic).to_owned(),
        message_id: record
            .headers()
            .and_then(|headers| headers.iter().find(|h| h.key == MESSAGE_ID_HEADER))
            .and_then(|header| header.value)
            .map(id_text),
        attempted_at: header_str(record, ATTEMPTS_HEADER)
            .map(|times| times.split(',').filter_map(parse_rfc3339).collect())
            .unwrap_or_default(),
        reason: header_str(record, REASON_HEADER)
            .unwrap_or_default()
            .to_owned(),
        body: Bytes::copy_from_slice(record.payload().unwrap_or_default()),
        truncated: header_str(record, TRUNCATED_HEADER).and_then(|size| size.parse().ok()),
        partition: record.partition(),
        offset: record.offset(),
    }
}
