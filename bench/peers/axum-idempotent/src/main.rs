//! axum-idempotent 0.6 on one of ruts 0.13's session stores, in front of the
//! bench's trivial handler: `POST /layered`, `POST /layered-slow`, `GET
//! /executions` (see `bench/peers/README.md`).
//!
//! `--store memory`: ruts' in-memory `MokaStore`, holding up to 1,000,000
//! sessions (moka's default is 10,000, which would evict the bench's sessions
//! and with them their records). `--store postgres://...`: ruts'
//! `PostgresStore` on a sqlx pool of `--pool` connections, its table created
//! at start-up, as ruts' README shows.
//!
//! Configured as axum-idempotent's README shows: direct key mode on a required
//! `Idempotency-Key` header; the layers `CookieManagerLayer`, `SessionLayer`,
//! `IdempotentLayer`, outermost first. The middleware records answers in the
//! request's session and never creates one, so every request carries a
//! `session` cookie (the bench derives one per key). Records and cookies live
//! 24 hours.

use std::sync::Arc;

use axum::Router;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::SessionStore;
use ruts::store::moka::MokaStore;
use ruts::store::postgres::PostgresStoreBuilder;
use ruts::{CookieOptions, SessionLayer};
use sqlx::postgres::PgPoolOptions;
use tower_cookies::CookieManagerLayer;

#[path = "../../common.rs"]
mod common;

use common::{BoxError, Options};

/// A day, in seconds: how long records (and session cookies) live.
const RETENTION: i64 = 24 * 3600;

fn main() -> std::process::ExitCode {
    common::exit(run())
}

fn run() -> Result<(), BoxError> {
    let options = Options::from_args()?;
    common::serve(&options, || async {
        if options.store == "memory" {
            let store = MokaStore::builder().max_capacity(1_000_000).build();
            return Ok(layered(Arc::new(store)));
        }
        let pool = PgPoolOptions::new()
            .max_connections(options.pool)
            .connect(&options.store)
            .await?;
        let store = PostgresStoreBuilder::new(pool)
            .create_table(true)
            .build()
            .await?;
        Ok(layered(Arc::new(store)))
    })
}

/// The bench's routes behind the idempotency and session layers, on `store`.
fn layered<T: SessionStore>(store: Arc<T>) -> Router {
    let idempotent = IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(RETENTION);
    let cookies = CookieOptions::build()
        .name("session")
        .max_age(RETENTION as u64)
        .path("/");
    common::routes()
        .layer(IdempotentLayer::<T>::new(idempotent))
        .layer(SessionLayer::new(store).with_cookie_options(cookies))
        .layer(CookieManagerLayer::new())
}
