//! `--publish`: every charge and deposit applied stages one event in its own
//! transaction, and the service's relay publishes it (`docs/contract.md` §11,
//! idem-diesel's outbox).

use std::time::Duration;

use idem_diesel::{Event, PgOutbox, SqliteOutbox};
use idem_rabbitmq::lapin::{Connection, ConnectionProperties};
use idem_rabbitmq::{OutboxPublisher, Topology};

use crate::{Operation, StartError};

/// Where events go when `--publish-to` is not given.
pub const DEFAULT_PUBLISH_TO: &str = "payments";

/// The partitions of a Kafka topic the service creates (each account's events
/// stay in one, keyed by the account).
const TOPIC_PARTITIONS: i32 = 3;

/// How long sent events are kept before the outbox's cleanup deletes them.
const SENT_RETENTION: Duration = Duration::from_secs(60 * 60);

/// A `--publish` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PublishUrl {
    /// `amqp://…`: RabbitMQ, to a queue.
    Amqp(String),
    /// `kafka://HOST:PORT[,…]`: a Kafka-compatible broker, to a topic.
    Kafka(String),
}

/// The ledger's side of publishing: the outbox in its database, and where
/// the events go.
#[derive(Clone)]
pub(crate) struct Publishing {
    destination: String,
    pub(crate) outbox: PublishingOutbox,
}

/// The outbox, in the ledger's database.
#[derive(Clone)]
pub(crate) enum PublishingOutbox {
    Postgres(PgOutbox),
    Sqlite(SqliteOutbox),
}

impl PublishUrl {
    /// Parses a `--publish` URL; an error never repeats it (it may hold a
    /// password).
    ///
    /// ```
    /// use payments::PublishUrl;
    ///
    /// assert!(matches!(PublishUrl::parse("amqp://guest:guest@127.0.0.1:5672/%2f"), Ok(PublishUrl::Amqp(_))));
    /// assert!(matches!(PublishUrl::parse("kafka://127.0.0.1:9092"), Ok(PublishUrl::Kafka(_))));
    /// assert!(PublishUrl::parse("http://example.com").is_err());
    /// ```
    pub fn parse(url: &str) -> Result<Self, StartError> {
        if url.starts_with("amqp://") {
            Ok(Self::Amqp(url.to_owned()))
        } else if url.starts_with("kafka://") {
            Ok(Self::Kafka(url.to_owned()))
        } else {
            Err(StartError::UnknownPublishUrl)
        }
    }
}

impl Publishing {
    /// Migrates the outbox, connects the publisher, declares the destination
    /// (as payments-consumer declares it) and starts the relay and the
    /// outbox's cleanup on the current runtime.
    pub(crate) async fn start(
        url: &PublishUrl,
        destination: &str,
        outbox: PublishingOutbox,
    ) -> Result<Self, StartError> {
        let kind = outbox.kind();
        let failed = |source| StartError::Outbox { kind, source };
        match &outbox {
            PublishingOutbox::Postgres(outbox) => outbox.migrate().await.map_err(failed)?,
            PublishingOutbox::Sqlite(outbox) => outbox.migrate().await.map_err(failed)?,
        }
        match url {
            PublishUrl::Amqp(url) => {
                let publisher = OutboxPublisher::connect(url)
                    .await
                    .map_err(StartError::Publisher)?;
                declare(url, destination).await?;
                outbox.relay_with(publisher)?;
            }
            PublishUrl::Kafka(url) => {
                let servers = url.trim_start_matches("kafka://").trim_end_matches('/');
                let publisher = idem_kafka::OutboxPublisher::connect(servers)
                    .map_err(StartError::KafkaPublisher)?;
                idem_kafka::create_topic(servers, destination, TOPIC_PARTITIONS)
                    .await
                    .map_err(StartError::KafkaPublisher)?;
                outbox.relay_with(publisher)?;
            }
        }
        tracing::info!(destination = %idem_core::log::bounded(destination), "publishing events through the outbox");
        Ok(Self {
            destination: destination.to_owned(),
            outbox,
        })
    }

    /// The event of an applied operation: `{"account_id", "amount"}`, keyed
    /// by the account, so that each account's events leave in order.
    pub(crate) fn event(&self, operation: &Operation) -> Event {
        let body = serde_json::json!({
            "account_id": operation.account_id,
            "amount": operation.amount,
        });
        Event::new(
            self.destination.clone(),
            operation.account_id.clone(),
            body.to_string(),
        )
        .header("content-type", "application/json")
    }
}

impl PublishingOutbox {
    /// The outbox in the PostgreSQL store's database.
    pub(crate) fn postgres(pool: idem_diesel::PgPool) -> Self {
        Self::Postgres(PgOutbox::builder().retention(SENT_RETENTION).build(pool))
    }

    /// The outbox in the SQLite store's file.
    pub(crate) fn sqlite(pool: idem_diesel::SqlitePool) -> Self {
        Self::Sqlite(
            SqliteOutbox::builder()
                .retention(SENT_RETENTION)
                .build(pool),
        )
    }

    /// Starts the relay, publishing with `publisher`, and the cleanup, on
    /// the current runtime.
    fn relay_with(&self, publisher: impl idem_diesel::Publish) -> Result<(), StartError> {
        match self {
            Self::Postgres(outbox) => {
                let relay = outbox.relay(publisher).map_err(StartError::Relay)?;
                tokio::spawn(relay.run(std::future::pending()));
                tokio::spawn(outbox.cleanup().run(std::future::pending()));
            }
            Self::Sqlite(outbox) => {
                let relay = outbox.relay(publisher).map_err(StartError::Relay)?;
                tokio::spawn(relay.run(std::future::pending()));
                tokio::spawn(outbox.cleanup().run(std::future::pending()));
            }
        }
        Ok(())
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Postgres(_) => "PostgreSQL",
            Self::Sqlite(_) => "SQLite",
        }
    }
}

/// Declares the destination queue as payments-consumer does (its
/// `Topology`), so that either may start first.
async fn declare(url: &str, queue: &str) -> Result<(), StartError> {
    let failed = |source| {
        StartError::Publisher(idem_rabbitmq::Error::Broker {
            step: "declare the destination queue".to_owned(),
            source,
        })
    };
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(failed)?;
    let channel = connection.create_channel().await.map_err(failed)?;
    let declared = Topology::new(queue).declare(&channel).await;
    let _ = connection.close(200, "declared".into()).await;
    declared.map_err(StartError::Publisher)
}
