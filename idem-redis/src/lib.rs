#![doc = include_str!("../README.md")]

mod connection;
mod error;
mod key;
mod store;

pub use connection::RedisConnection;
pub use error::SetupError;
pub use store::{DEFAULT_PREFIX, RedisStore, RedisStoreBuilder};
