//! A producer helper: deduplication ids from the content, groups, and the
//! `message_id` attribute the consumer keys by.

use aws_sdk_sqs::Client;

use crate::Error;
use crate::message::{self, MESSAGE_ID_ATTRIBUTE};
use crate::queue;

/// Sends messages to one queue: on a FIFO queue with a
/// `MessageDeduplicationId` (the SHA-256 of the canonical content, or an
/// explicit id) and a `MessageGroupId`; on any queue with the `message_id`
/// attribute when one is given.
///
/// ```no_run
/// use idem_sqs::{ClientConfig, Outgoing, Publisher};
///
/// # async fn send() -> Result<(), idem_sqs::Error> {
/// let client = ClientConfig::from_env().build()?;
/// let publisher = Publisher::new(client, "https://sqs.us-east-1.amazonaws.com/123456789012/payments.fifo")?;
/// let body = r#"{"account_id": "acc_1", "amount": 5}"#;
/// // Deduplicated by SQS for 5 minutes by the SHA-256 of the content, in
/// // order within the account's group.
/// publisher.send(&Outgoing::new(body).group("acc_1")).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Publisher {
    client: Client,
    queue_url: String,
    fifo: bool,
}

/// A message to send with a [`Publisher`].
#[derive(Clone, PartialEq, Eq)]
#[must_use]
pub struct Outgoing {
    body: String,
    message_id: Option<String>,
    group: Option<String>,
    deduplication: Deduplication,
}

/// Where a FIFO message's `MessageDeduplicationId` comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Deduplication {
    /// The SHA-256 of the canonical content ([`content_digest`](crate::content_digest)):
    /// the same payment sent twice within 5 minutes is one message. The
    /// default.
    Content,
    /// This id.
    Explicit(String),
}

/// What SQS answered to a send.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sent {
    /// SQS's `MessageId` (a deduplicated send answers the first one's).
    pub sqs_message_id: Option<String>,
    /// The deduplication id sent (FIFO queues).
    pub deduplication_id: Option<String>,
}

impl Publisher {
    /// A publisher to the queue at `queue_url` (a FIFO queue when its name
    /// ends in `.fifo`, as SQS requires).
    pub fn new(client: Client, queue_url: impl Into<String>) -> Result<Self, Error> {
        let queue_url = queue_url.into();
        let fifo = queue::queue_name(&queue_url)?.ends_with(".fifo");
        Ok(Self {
            client,
            queue_url,
            fifo,
        })
    }

    /// Sends `outgoing`. On a FIFO queue a group is required.
    pub async fn send(&self, outgoing: &Outgoing) -> Result<Sent, Error> {
        let mut send = self
            .client
            .send_message()
            .queue_url(&self.queue_url)
            .message_body(&outgoing.body);
        if let Some(id) = &outgoing.message_id
            && let Some(value) = message::string(id)
        {
            send = send.message_attributes(MESSAGE_ID_ATTRIBUTE, value);
        }
        let mut deduplication_id = None;
        if self.fifo {
            let group = outgoing.group.as_deref().ok_or_else(|| {
                Error::Invalid(
                    "a message to a FIFO queue needs a group (Outgoing::group)".to_owned(),
                )
            })?;
            let id = outgoing.deduplication_id();
            send = send.message_group_id(group).message_deduplication_id(&id);
            deduplication_id = Some(id);
        }
        let answer = send.send().await.map_err(Error::sqs("send a message"))?;
        Ok(Sent {
            sqs_message_id: answer.message_id().map(str::to_owned),
            deduplication_id,
        })
    }
}

impl Outgoing {
    /// A message with `body`, deduplicated by its content, without a
    /// `message_id` attribute or a group.
    pub fn new(body: impl Into<String>) -> Self {
        Self {
            body: body.into(),
            message_id: None,
            group: None,
            deduplication: Deduplication::Content,
        }
    }

    /// Sets the `message_id` attribute: the consumer's idempotency key.
    pub fn message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Sets the `MessageGroupId`: FIFO queues keep each group's order
    /// (ignored on a standard queue).
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }

    /// Sets where the deduplication id comes from (default
    /// [`Deduplication::Content`]).
    pub fn deduplication(mut self, deduplication: Deduplication) -> Self {
        self.deduplication = deduplication;
        self
    }

    /// The deduplication id a FIFO queue gets.
    pub fn deduplication_id(&self) -> String {
        match &self.deduplication {
            Deduplication::Content => message::content_digest(&self.body),
            Deduplication::Explicit(id) => id.clone(),
        }
    }
}

impl std::fmt::Debug for Outgoing {
    /// Never the body, never the whole message id.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing")
            .field("body_len", &self.body.len())
            .field(
                "message_id",
                &self.message_id.as_deref().map(idem_core::Redacted::of),
            )
            .field("group", &self.group)
            .field("deduplication", &self.deduplication)
            .finish()
    }
}
