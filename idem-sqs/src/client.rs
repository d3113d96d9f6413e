//! The SDK's client, built from the environment without aws-config.

use std::time::Duration;

use aws_sdk_sqs::config::timeout::TimeoutConfig;
use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};

use crate::Error;

/// The region used when `AWS_REGION` is not set.
pub const DEFAULT_REGION: &str = "us-east-1";

/// How long one attempt of a call may take by default
/// ([`ClientConfig::attempt_timeout`]): longer than a long poll's 20 s.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a connection to SQS may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How to reach SQS: the region, the credentials and the endpoint, read from
/// the environment as the AWS SDK reads them, each replaceable.
///
/// - region: `AWS_REGION`, else `AWS_DEFAULT_REGION`, else
///   [`DEFAULT_REGION`];
/// - credentials: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and, for
///   temporary ones, `AWS_SESSION_TOKEN`;
/// - endpoint: `AWS_ENDPOINT_URL_SQS`, else `AWS_ENDPOINT_URL`, else AWS's
///   own for the region.
///
/// Profiles (`~/.aws`), SSO, web identity and instance metadata are not
/// read: an application that needs them builds its client with `aws-config`
/// and hands it to [`Consumer::builder`](crate::Consumer::builder) and the
/// other functions, which take any [`aws_sdk_sqs::Client`].
///
/// ```
/// let client = idem_sqs::ClientConfig::from_env()
///     .endpoint("http://127.0.0.1:5000") // a local SQS
///     .credentials("test", "test")
///     .build()?;
/// # let _ = client;
/// # Ok::<(), idem_sqs::Error>(())
/// ```
#[derive(Clone)]
#[must_use]
pub struct ClientConfig {
    region: String,
    endpoint: Option<String>,
    credentials: Option<Credentials>,
    attempt_timeout: Duration,
}

impl ClientConfig {
    /// The region, credentials and endpoint of the environment.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
        let credentials = match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
            (Some(id), Some(secret)) => Some(Credentials::new(
                id,
                secret,
                var("AWS_SESSION_TOKEN"),
                None,
                "environment",
            )),
            _ => None,
        };
        Self {
            region: var("AWS_REGION")
                .or_else(|| var("AWS_DEFAULT_REGION"))
                .unwrap_or_else(|| DEFAULT_REGION.to_owned()),
            endpoint: var("AWS_ENDPOINT_URL_SQS").or_else(|| var("AWS_ENDPOINT_URL")),
            credentials,
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
        }
    }

    /// How long one attempt of a call may take (default
    /// [`DEFAULT_ATTEMPT_TIMEOUT`]) before it is given up and retried, on
    /// another connection, as the SDK's standard retries go: a connection
    /// that stopped answering without closing (a network that drops the
    /// packets) never holds a call, a lease's extension or a receive for
    /// good. Keep it above the consumer's long poll
    /// ([`ConsumerBuilder::wait_time`](crate::ConsumerBuilder::wait_time)),
    /// or an empty queue's receives time out and are retried.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// Another endpoint (a local SQS such as moto's server, or a VPC
    /// endpoint).
    pub fn endpoint(mut self, url: impl Into<String>) -> Self {
        self.endpoint = Some(url.into());
        self
    }

    /// Another region.
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = region.into();
        self
    }

    /// Static credentials instead of the environment's.
    pub fn credentials(mut self, access_key_id: &str, secret_access_key: &str) -> Self {
        self.credentials = Some(Credentials::new(
            access_key_id,
            secret_access_key,
            None,
            None,
            "idem-sqs",
        ));
        self
    }

    /// The client: HTTPS with rustls (on ring) and the system's root
    /// certificates, the SDK's standard retries, each attempt bounded
    /// ([`attempt_timeout`](Self::attempt_timeout); a connection opens
    /// within 5 s). Fails without credentials.
    pub fn build(self) -> Result<aws_sdk_sqs::Client, Error> {
        let credentials = self.credentials.ok_or(Error::NoCredentials)?;
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
            .build_https();
        let mut config = aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(self.region))
            .credentials_provider(credentials)
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(CONNECT_TIMEOUT)
                    .operation_attempt_timeout(self.attempt_timeout)
                    .build(),
            )
            .http_client(http);
        if let Some(endpoint) = self.endpoint {
            config = config.endpoint_url(endpoint);
        }
        Ok(aws_sdk_sqs::Client::from_conf(config.build()))
    }
}

impl std::fmt::Debug for ClientConfig {
    /// Never the credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("region", &self.region)
            .field("endpoint", &self.endpoint)
            .field("credentials", &self.credentials.as_ref().map(|_| "set"))
            .field("attempt_timeout", &self.attempt_timeout)
            .finish()
    }
}
