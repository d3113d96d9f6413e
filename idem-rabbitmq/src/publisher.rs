//! Publishing with confirms and a stable `message_id`.

use idem_core::consume::Message;
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use crate::Error;
use crate::broker::{Address, publish_confirmed};
use crate::message::{PERSISTENT, long_string};

/// Publishes messages to queues through the default exchange, each
/// persistent, with its `message_id` (the consumer's idempotency key), and
/// confirmed by the broker before [`publish`](Self::publish) answers.
///
/// A publish that fails may or may not have reached the queue: publish the
/// same message again, **with the id the first call answered**, and the
/// consumer's inbox applies it once. A connection found closed is opened
/// again at the next publish.
pub struct Publisher {
    address: Address,
    open: Mutex<Option<(Connection, Channel)>>,
}

impl Publisher {
    /// Connects to the broker at `url` (`amqp://user:password@host:port/vhost`).
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let address = Address::parse(url)?;
        let open = address.open_confirmed("idem-rabbitmq publisher").await?;
        Ok(Self {
            address,
            open: Mutex::new(Some(open)),
        })
    }

    /// Publishes `message` to `queue` and waits for the broker's
    /// confirmation; answers its `message_id`: the message's own
    /// ([`Message::id`]), or a new UUID v7 when it has none. Its headers go
    /// as AMQP string headers. A queue that does not exist is an error
    /// ([`Error::NotConfirmed`], unroutable), not a silent drop.
    pub async fn publish(&self, queue: &str, message: &Message) -> Result<String, Error> {
        let id = message
            .message_id()
            .map_or_else(|| uuid::Uuid::now_v7().to_string(), str::to_owned);
        let properties = properties(&id, message)?;
        let channel = self.channel().await?;
        publish_confirmed(&channel, queue, message.body(), properties).await?;
        Ok(id)
    }

    /// Closes the connection.
    pub async fn close(self) {
        if let Some((connection, channel)) = self.open.lock().await.take() {
            let _ = channel.close(200, "bye".into()).await;
            let _ = connection.close(200, "bye".into()).await;
        }
    }

    /// The open channel, opened again if the connection was lost.
    async fn channel(&self) -> Result<Channel, Error> {
        let mut open = self.open.lock().await;
        if let Some((connection, channel)) = open.as_ref()
            && connection.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        *open = None;
        let (connection, channel) = self
            .address
            .open_confirmed("idem-rabbitmq publisher")
            .await?;
        *open = Some((connection, channel.clone()));
        Ok(channel)
    }
}

fn properties(id: &str, message: &Message) -> Result<BasicProperties, Error> {
    let message_id = ShortString::try_new(id).map_err(|_| {
        Error::Invalid(format!(
            "a message id has at most 255 bytes, not {}",
            id.len()
        ))
    })?;
    let mut headers = FieldTable::default();
    for (name, value) in message.headers() {
        let name = ShortString::try_new(name.as_str()).map_err(|_| {
            Error::Invalid(format!(
                "a header name has at most 255 bytes, not {}",
                name.len()
            ))
        })?;
        headers.insert(name, long_string(value));
    }
    Ok(BasicProperties::default()
        .with_message_id(message_id)
        .with_delivery_mode(PERSISTENT)
        .with_headers(headers))
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("broker", &self.address)
            .finish_non_exhaustive()
    }
}
