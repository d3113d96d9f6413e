//! The durable stores the suite runs over, fresh for each case: a SQLite file
//! in a temporary directory, a database of its own on the test binary's
//! shared PostgreSQL cluster ([`TestPostgres::shared`]), and a key prefix of
//! its own on a test Redis ([`redis_store`]).

use std::sync::Arc;

use idem_core::Store;
use idem_core::store::StoreLayer;
use idem_diesel::{PgStore, SqliteStore};
use idem_redis::RedisStore;
use idem_testkit::{Error as ClusterError, TestPostgres, TestRedis};

/// A fresh SQLite store in a temporary directory, deleted with the store.
///
/// # Panics
///
/// When the file cannot be made or migrated.
pub async fn sqlite_store() -> Arc<dyn Store> {
    let dir = TempDir::new("scenarios").unwrap_or_else(|error| panic!("a directory: {error}"));
    let store = migrated_sqlite(&dir.file("idem.db")).await;
    Arc::new(Owning { store, _owned: dir })
}

/// A fresh PostgreSQL store: a new database on the binary's shared cluster.
///
/// # Panics
///
/// When PostgreSQL cannot be started (the message says what to install) or the
/// database made.
pub async fn postgres_store() -> Arc<dyn Store> {
    Arc::new(migrated_postgres(&fresh_postgres_url("scenario").await).await)
}

/// The URL of a new database named after `prefix` on the binary's shared
/// cluster.
///
/// # Panics
///
/// When PostgreSQL cannot be started (the message says what to install) or the
/// database made.
pub async fn fresh_postgres_url(prefix: &'static str) -> String {
    tokio::task::spawn_blocking(move || {
        let cluster = TestPostgres::shared()?;
        let database = cluster.fresh_database(prefix)?;
        Ok::<_, ClusterError>(cluster.url(&database))
    })
    .await
    .unwrap_or_else(|error| panic!("the cluster's task failed: {error}"))
    .unwrap_or_else(|error| panic!("cannot start a PostgreSQL cluster: {error}"))
}

/// A `RedisStore` on `redis` under a [fresh prefix](TestRedis::fresh_prefix),
/// with the default settings otherwise.
///
/// # Panics
///
/// When it cannot connect.
pub async fn redis_store(redis: &TestRedis) -> RedisStore {
    RedisStore::builder()
        .prefix(redis.fresh_prefix())
        .connect(&redis.url())
        .await
        .unwrap_or_else(|error| panic!("cannot connect to the test Redis: {error}"))
}

/// A `PgStore` on `url`, its table migrated.
///
/// # Panics
///
/// When it cannot connect or migrate.
pub async fn migrated_postgres(url: &str) -> PgStore {
    let store = PgStore::connect(url)
        .await
        .unwrap_or_else(|error| panic!("cannot connect to {url}: {error}"));
    store
        .migrate()
        .await
        .unwrap_or_else(|error| panic!("cannot migrate {url}: {error}"));
    store
}

/// A `SqliteStore` on the file at `path`, its table migrated.
///
/// # Panics
///
/// When it cannot open or migrate the file.
pub async fn migrated_sqlite(path: &str) -> SqliteStore {
    let store = SqliteStore::connect(path)
        .await
        .unwrap_or_else(|error| panic!("cannot open {path}: {error}"));
    store
        .migrate()
        .await
        .unwrap_or_else(|error| panic!("cannot migrate {path}: {error}"));
    store
}

/// A temporary directory, deleted when dropped: testkit's.
pub use idem_testkit::TempDir;

/// A store and what must live exactly as long as it (its temporary directory).
struct Owning<S, G> {
    store: S,
    _owned: G,
}

impl<S: Store, G: Send + Sync + 'static> StoreLayer for Owning<S, G> {
    fn inner(&self) -> &dyn Store {
        &self.store
    }
}
