//! A queue's attributes and its dead-letter queue.

use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::QueueAttributeName;

use crate::Error;

/// The longest queue name SQS accepts.
pub const MAX_QUEUE_NAME_LEN: usize = 80;

/// How long a dead-letter queue this crate creates keeps its messages: 14
/// days, SQS's longest.
const DEAD_LETTER_RETENTION_SECS: &str = "1209600";

/// What the consumer and the dead-letter functions read of a queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Queue {
    pub(crate) url: String,
    pub(crate) name: String,
    pub(crate) fifo: bool,
    /// The queue's own visibility timeout.
    pub(crate) visibility_timeout: Duration,
    /// Its redrive policy, if it has one.
    pub(crate) redrive: Option<RedrivePolicy>,
}

/// A queue's redrive policy: SQS moves a message to `target_arn` at the
/// receive after `max_receive_count`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RedrivePolicy {
    pub(crate) target_arn: String,
    pub(crate) max_receive_count: u32,
}

/// The queue's name: the last segment of its URL
/// (`https://sqs.REGION.amazonaws.com/ACCOUNT/NAME`).
pub fn queue_name(queue_url: &str) -> Result<&str, Error> {
    let name = queue_url
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default();
    let valid = !name.is_empty()
        && name.len() <= MAX_QUEUE_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid && queue_url.contains("://") {
        Ok(name)
    } else {
        Err(Error::InvalidQueueUrl(
            "expected http(s)://HOST/ACCOUNT/NAME, with a name of 1 to 80 letters, digits, '-' or '_' (and '.fifo')".to_owned(),
        ))
    }
}

/// The name of the dead-letter queue this crate uses for `queue` when its
/// queue has no redrive policy: `<queue>-dlq`, or `<name>-dlq.fifo` for a
/// FIFO queue `<name>.fifo`.
pub fn dead_letter_queue_name(queue: &str) -> String {
    match queue.strip_suffix(".fifo") {
        Some(name) => format!("{name}-dlq.fifo"),
        None => format!("{queue}-dlq"),
    }
}

impl Queue {
    /// Reads the queue's attributes.
    pub(crate) async fn describe(client: &Client, url: &str) -> Result<Self, Error> {
        let name = queue_name(url)?.to_owned();
        let answer = client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await
            .map_err(Error::sqs(format!(
                "read the attributes of the queue {name:?}"
            )))?;
        let attributes = answer.attributes();
        let get = |attribute: QueueAttributeName| attributes.and_then(|a| a.get(&attribute));
        let fifo = get(QueueAttributeName::FifoQueue).is_some_and(|v| v == "true")
            || name.ends_with(".fifo");
        let visibility_timeout = get(QueueAttributeName::VisibilityTimeout)
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(Duration::from_secs(30), Duration::from_secs);
        let redrive = get(QueueAttributeName::RedrivePolicy)
            .filter(|policy| !policy.is_empty())
            .map(|policy| RedrivePolicy::parse(policy))
            .transpose()?;
        Ok(Self {
            url: url.to_owned(),
            name,
            fifo,
            visibility_timeout,
            redrive,
        })
    }

    /// The URL of the queue's dead-letter queue: its redrive policy's
    /// target, else `<name>-dlq` (created if absent when `create`). `None`
    /// when it does not exist and `create` is false.
    pub(crate) async fn dead_letter_queue(
        &self,
        client: &Client,
        create: bool,
    ) -> Result<Option<String>, Error> {
        if let Some(redrive) = &self.redrive {
            // arn:aws:sqs:REGION:ACCOUNT:NAME
            let mut parts = redrive.target_arn.rsplit(':');
            let (Some(name), Some(account)) = (parts.next(), parts.next()) else {
                return Err(Error::Unexpected(
                    "the redrive policy's deadLetterTargetArn is not an SQS ARN".to_owned(),
                ));
            };
            let found = client
                .get_queue_url()
                .queue_name(name)
                .queue_owner_aws_account_id(account)
                .send()
                .await;
            return match found {
                Ok(answer) => Ok(answer.queue_url().map(str::to_owned)),
                Err(error) => {
                    let error = Error::sqs(format!("find the dead-letter queue {name:?}"))(error);
                    if error.is_no_such_queue() && !create {
                        Ok(None)
                    } else {
                        Err(error)
                    }
                }
            };
        }
        let name = dead_letter_queue_name(&self.name);
        if name.len() > MAX_QUEUE_NAME_LEN {
            return Err(Error::Invalid(format!(
                "the dead-letter queue's name {name:?} is over {MAX_QUEUE_NAME_LEN} characters: give the queue a redrive policy naming its dead-letter queue"
            )));
        }
        let found = client.get_queue_url().queue_name(&name).send().await;
        match found {
            Ok(answer) => return Ok(answer.queue_url().map(str::to_owned)),
            Err(error) => {
                let error = Error::sqs(format!("find the dead-letter queue {name:?}"))(error);
                if !error.is_no_such_queue() {
                    return Err(error);
                }
                if !create {
                    return Ok(None);
                }
            }
        }
        let mut create = client.create_queue().queue_name(&name).attributes(
            QueueAttributeName::MessageRetentionPeriod,
            DEAD_LETTER_RETENTION_SECS,
        );
        if self.fifo {
            create = create.attributes(QueueAttributeName::FifoQueue, "true");
        }
        let created = create
            .send()
            .await
            .map_err(Error::sqs(format!("create the dead-letter queue {name:?}")))?;
        tracing::info!(queue = %self.name, dead_letter_queue = %name, "created the dead-letter queue");
        Ok(created.queue_url().map(str::to_owned))
    }
}

impl RedrivePolicy {
    /// `{"deadLetterTargetArn": "...", "maxReceiveCount": N}` (the count a
    /// number or a string).
    fn parse(policy: &str) -> Result<Self, Error> {
        let invalid = || Error::Unexpected("the queue's RedrivePolicy cannot be read".to_owned());
        let value: serde_json::Value = serde_json::from_str(policy).map_err(|_| invalid())?;
        let target_arn = value
            .get("deadLetterTargetArn")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(invalid)?
            .to_owned();
        let max_receive_count = match value.get("maxReceiveCount") {
            Some(serde_json::Value::Number(n)) => n.as_u64(),
            Some(serde_json::Value::String(s)) => s.parse().ok(),
            _ => None,
        }
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(invalid)?;
        Ok(Self {
            target_arn,
            max_receive_count,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_url_and_dead_letter_queues_keep_fifo() {
        assert_eq!(
            queue_name("http://127.0.0.1:5000/123456789012/payments").ok(),
            Some("payments")
        );
        assert_eq!(
            queue_name("https://sqs.eu-west-1.amazonaws.com/1/orders.fifo/").ok(),
            Some("orders.fifo")
        );
        assert!(queue_name("payments").is_err());
        assert!(queue_name("http://host/1/bad name").is_err());
        assert_eq!(dead_letter_queue_name("payments"), "payments-dlq");
        assert_eq!(dead_letter_queue_name("orders.fifo"), "orders-dlq.fifo");
    }

    #[test]
    fn a_redrive_policy_reads_its_count_as_a_number_or_a_string() {
        let policy = RedrivePolicy::parse(
            r#"{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:dl","maxReceiveCount":"5"}"#,
        );
        assert_eq!(
            policy.ok().map(|p| (p.target_arn, p.max_receive_count)),
            Some(("arn:aws:sqs:us-east-1:1:dl".to_owned(), 5))
        );
        assert!(RedrivePolicy::parse("{}").is_err());
    }
}
