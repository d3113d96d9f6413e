//! cratestack-axum 0.8's `IdempotencyLayer` on `SqlxIdempotencyStore`
//! (cratestack-sqlx 0.8, PostgreSQL), in front of the bench's trivial handler:
//! `POST /layered`, `POST /layered-slow`, `GET /executions` (see
//! `bench/peers/README.md`).
//!
//! Configured as its README shows: a sqlx pool of `--pool` connections, the
//! store's table created with `ensure_schema`, records kept 24 hours. Every
//! request is in one principal namespace (`with_principal_fingerprint`), as
//! the idem route puts every request in one scope.

use std::sync::Arc;
use std::time::Duration;

use cratestack_axum::idempotency::IdempotencyLayer;
use cratestack_sqlx::SqlxIdempotencyStore;
use cratestack_sqlx::sqlx::postgres::PgPoolOptions;

#[path = "../../common.rs"]
mod common;

use common::{BoxError, Options};

fn main() -> std::process::ExitCode {
    common::exit(run())
}

fn run() -> Result<(), BoxError> {
    let options = Options::from_args()?;
    if !options.store.starts_with("postgres") {
        return Err(format!(
            "--store {}: this peer serves from PostgreSQL only",
            options.store
        )
        .into());
    }
    common::serve(&options, || async {
        let pool = PgPoolOptions::new()
            .max_connections(options.pool)
            .connect(&options.store)
            .await?;
        let store = SqlxIdempotencyStore::new(pool);
        store.ensure_schema().await?;
        let layer = IdempotencyLayer::new(Arc::new(store), Duration::from_secs(24 * 3600))
            .with_principal_fingerprint(|_| "bench".to_owned());
        Ok(common::routes().layer(layer))
    })
}
