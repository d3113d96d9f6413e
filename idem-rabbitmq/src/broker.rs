//! Connecting and publishing with confirms: what every part of the crate
//! shares.

use idem_core::log::bounded;
use std::fmt;
use std::str::FromStr;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::LongString;
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use crate::Error;

/// A broker's address, parsed once; shown without its password.
#[derive(Clone)]
pub(crate) struct Address {
    uri: AMQPUri,
}

impl Address {
    /// Parses `url` (`amqp://user:password@host:port/vhost`); an error never
    /// repeats the URL.
    pub(crate) fn parse(url: &str) -> Result<Self, Error> {
        AMQPUri::from_str(url).map(|uri| Self { uri }).map_err(|_| {
            // The parser's messages may quote any part of the URL, the
            // password included: none of its text is kept.
            Error::InvalidUrl("not an amqp://user:password@host:port/vhost URL".to_owned())
        })
    }

    /// Opens a connection named `name` (shown in RabbitMQ's management).
    pub(crate) async fn connect(&self, name: &str) -> Result<Connection, Error> {
        let properties = ConnectionProperties::default()
            .with_connection_name(LongString::from(name.as_bytes().to_vec()));
        Connection::connect_uri(self.uri.clone(), properties)
            .await
            .map_err(Error::broker(format!("connect to {self}")))
    }

    /// Opens a connection and a channel in confirm mode.
    pub(crate) async fn open_confirmed(&self, name: &str) -> Result<(Connection, Channel), Error> {
        let connection = self.connect(name).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(Error::broker("open a channel"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(Error::broker("enable publisher confirms"))?;
        Ok((connection, channel))
    }
}

impl fmt::Display for Address {
    /// `amqp://user@host:port/vhost`: never the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let authority = &self.uri.authority;
        write!(
            f,
            "{}://{}@{}:{}/{}",
            self.uri.scheme,
            authority.userinfo.username,
            authority.host,
            authority.port,
            self.uri.vhost.replace('%', "%25").replace('/', "%2f")
        )
    }
}

impl fmt::Debug for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Publishes `body` to `queue` through the default exchange on a channel in
/// confirm mode, `mandatory` (a queue missing is an error, not a silent
/// drop), and waits for the broker's confirmation.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), Error> {
    let confirmation = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        )
        .await
        .map_err(Error::broker(format!("publish to {}", bounded(queue))))?
        .await
        .map_err(Error::broker(format!(
            "have a message to {} confirmed",
            bounded(queue)
        )))?;
    let why = match confirmation {
        Confirmation::Ack(None) => return Ok(()),
        Confirmation::Ack(Some(_)) => "unroutable (no such queue)",
        Confirmation::Nack(_) => "refused",
        Confirmation::NotRequested => "the channel is not in confirm mode",
    };
    Err(Error::NotConfirmed {
        destination: bounded(queue).to_string(),
        why,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_address_never_shows_its_password() {
        let address = Address::parse("amqp://app:s3cr3t@broker:5673/%2f").unwrap();
        assert_eq!(address.to_string(), "amqp://app@broker:5673/%2f");
        assert!(!format!("{address:?}").contains("s3cr3t"));
        let Err(error) = Address::parse("amqp:s3cr3t@x") else {
            panic!("not a URL");
        };
        assert!(!error.to_string().contains("s3cr3t"), "{error}");
    }
}
