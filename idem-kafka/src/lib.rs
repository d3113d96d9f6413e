#![doc = include_str!("../README.md")]

/// Why a Kafka operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Not built yet.
    #[error("the Kafka consumer is not built yet")]
    NotBuilt,
}
