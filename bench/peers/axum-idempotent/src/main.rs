//! axum-idempotent 0.6 on ruts 0.13's in-memory session store (`MokaStore`),
//! in front of the bench's trivial handler: `POST /layered`, `POST
//! /layered-slow`, `GET /executions` (see `bench/peers/README.md`).
//!
//! Configured as its README shows: direct key mode on a required
//! `Idempotency-Key` header; the layers `CookieManagerLayer`, `SessionLayer`,
//! `IdempotentLayer`, outermost first. The middleware records answers in the
//! request's session and never creates one, so every request carries a
//! `session` cookie (the bench derives one per key). Records are kept 24 hours,
//! and the store holds up to 1,000,000 sessions (moka's default is 10,000, which
//! would evict the bench's sessions and with them their records).

use std::sync::Arc;

use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::moka::MokaStore;
use ruts::{CookieOptions, SessionLayer};
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
    if options.store != "memory" {
        return Err(format!(
            "--store {}: this peer serves from memory only",
            options.store
        )
        .into());
    }
    common::serve(&options, || async {
        let store = Arc::new(MokaStore::builder().max_capacity(1_000_000).build());
        let idempotent = IdempotentOptions::default()
            .use_idempotency_key_header(Some("Idempotency-Key"), true)
            .expire_after(RETENTION);
        let cookies = CookieOptions::build()
            .name("session")
            .max_age(RETENTION as u64)
            .path("/");
        Ok(common::routes()
            .layer(IdempotentLayer::<MokaStore>::new(idempotent))
            .layer(SessionLayer::new(store).with_cookie_options(cookies))
            .layer(CookieManagerLayer::new()))
    })
}
