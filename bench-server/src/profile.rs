//! `profile`: the axum routes driven in process, without sockets, so that an
//! instruction counter (`valgrind --tool=callgrind`) sees the layer's own work:
//! `n` requests with a 1 KiB JSON body to `/bare`, or to `/layered` with a
//! fresh key each (first executions) or one key (replays). Compare the totals
//! of two runs (say `--requests 20000` and `--requests 40000`) to get the
//! instructions per request without the start-up.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::routing::post;
use idem_axum::IdempotencyLayer;
use idem_core::{MemoryStore, Policy, Scope};
use tower::ServiceExt;

use crate::BoxError;
use crate::handler::{CONTENT_TYPE, SCOPE, answer};

/// What to drive.
#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// `bare`, `first` (fresh keys) or `replay` (one key).
    #[arg(long)]
    mode: String,
    /// How many requests.
    #[arg(long, default_value_t = 20_000)]
    requests: u64,
}

/// Drives the requests on a current-thread runtime; prints nothing but errors.
pub(crate) fn run(options: &Options) -> Result<(), BoxError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(drive(options))
}

async fn drive(options: &Options) -> Result<(), BoxError> {
    async fn charge(body: bytes::Bytes) -> impl axum::response::IntoResponse {
        (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, CONTENT_TYPE)],
            answer(body.len()),
        )
    }
    let store = Arc::new(MemoryStore::new());
    let app = Router::new().route("/bare", post(charge)).route(
        "/layered",
        post(charge).route_layer(
            IdempotencyLayer::new(store, Policy::required())
                .scope_with(|_| Some(Scope::new(SCOPE))),
        ),
    );
    let body = bytes::Bytes::from(format!("{{\"pad\":\"{}\"}}", "x".repeat(1014)));
    let path = if options.mode == "bare" {
        "/bare"
    } else {
        "/layered"
    };
    for i in 0..options.requests {
        let key = match options.mode.as_str() {
            "first" => format!("key-{i}"),
            _ => "key-replayed".to_owned(),
        };
        let request = Request::post(path)
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", key)
            .body(Body::from(body.clone()))?;
        let response = app.clone().oneshot(request).await?;
        if response.status() != StatusCode::CREATED {
            return Err(format!("request {i} answered {}", response.status()).into());
        }
        let _ = axum::body::to_bytes(response.into_body(), usize::MAX).await?;
    }
    Ok(())
}
