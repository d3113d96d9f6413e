//! Why a store could not be set up.

/// Why [`RedisStore::connect`](crate::RedisStore::connect) failed. The messages
/// never repeat the URL, which may hold a password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The URL is not a Redis URL (`redis://`, `rediss://`, `redis+cluster://`,
    /// `rediss+cluster://`), or its options are invalid.
    #[error("the Redis URL is invalid")]
    Url(#[source] redis::RedisError),
    /// A `redis+cluster://` URL names no node.
    #[error("the Redis Cluster URL names no node (redis+cluster://HOST:PORT[,HOST:PORT…])")]
    NoClusterNodes,
    /// The cluster could not be reached to read its slot map.
    #[error("could not connect to the Redis Cluster")]
    Connect(#[source] redis::RedisError),
    /// The key prefix holds `{` or `}`, which would change the keys' hash tags.
    #[error("the key prefix must not hold `{{` or `}}`")]
    Prefix,
}
