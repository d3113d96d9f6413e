#![doc = include_str!("../README.md")]

/// Why an SQS operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Not built yet.
    #[error("the SQS consumer is not built yet")]
    NotBuilt,
}
