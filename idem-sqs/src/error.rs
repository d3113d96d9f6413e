//! Why an SQS step failed.

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};

/// Why a consumer, a dead-letter operation or a publish failed. It never
/// holds a credential, a message id or a body.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No credentials in the environment (`AWS_ACCESS_KEY_ID` and
    /// `AWS_SECRET_ACCESS_KEY`), and none given.
    #[error(
        "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones)"
    )]
    NoCredentials,
    /// The inbox is not ready ([`Inbox::readiness`](idem_core::consume::Inbox::readiness)):
    /// its tables were not verified in this process. The consumer did not
    /// start; the message names the fix.
    #[error("the consumer did not start: {0}")]
    NotReady(#[from] idem_core::store::NotReady),
    /// A queue URL this crate cannot read a queue name from.
    #[error("the queue URL is invalid: {0}")]
    InvalidQueueUrl(String),
    /// A step on SQS failed: reading the queue's attributes, receiving,
    /// deleting, sending, changing a visibility.
    #[error("SQS: could not {step}")]
    Sqs {
        /// What was being done.
        step: String,
        /// The service's error code, when it answered one
        /// (`AWS.SimpleQueueService.NonExistentQueue`, `AccessDenied`…).
        code: Option<String>,
        /// The SDK's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// SQS answered something this crate cannot use (a queue attribute it
    /// cannot read, a batch entry without its result).
    #[error("SQS answered unexpectedly: {0}")]
    Unexpected(String),
    /// A name or a value SQS cannot carry (a queue name over 80 characters,
    /// a FIFO message without a group).
    #[error("{0}")]
    Invalid(String),
}

/// The error codes after which retrying cannot help: the queue does not
/// exist, the credentials are refused, access is denied.
const PERMANENT_CODES: &[&str] = &[
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
    "AccessDenied",
    "AccessDeniedException",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "SignatureDoesNotMatch",
    "InvalidAddress",
    "InvalidSecurity",
    "MissingAuthenticationToken",
];

impl Error {
    /// A step's error, keeping the service's code.
    pub(crate) fn sqs<E, R>(step: impl Into<String>) -> impl FnOnce(SdkError<E, R>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug + Send + Sync + 'static,
    {
        let step = step.into();
        move |source| Self::Sqs {
            step,
            code: source.code().map(str::to_owned),
            source: Box::new(source),
        }
    }

    /// The service's error code, when SQS answered one.
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Sqs { code, .. } => code.as_deref(),
            _ => None,
        }
    }

    /// Whether retrying cannot help: no credentials, the queue does not
    /// exist, the credentials or the access are refused, a name SQS cannot
    /// carry. The consumer stops on such an error instead of polling again.
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::NoCredentials
            | Self::InvalidQueueUrl(_)
            | Self::Invalid(_)
            | Self::NotReady(_) => true,
            Self::Sqs { code, .. } => code
                .as_deref()
                .is_some_and(|code| PERMANENT_CODES.contains(&code)),
            Self::Unexpected(_) => false,
        }
    }

    /// Whether SQS said the queue does not exist.
    pub fn is_no_such_queue(&self) -> bool {
        matches!(
            self.code(),
            Some("AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist")
        )
    }
}
