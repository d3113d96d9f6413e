//! What every peer shares, included by each (`#[path]`): its command line, its
//! runtime, the trivial handler and its execution counter, and how it serves.
//!
//! The handler is `bench-server`'s (see `bench-server/src/handler.rs`): a POST
//! of any body answers `201` `application/json`
//! `{"id":"ch_bench","status":"succeeded","received":N}`. The runtime is
//! `bench-server serve`'s: a multi-threaded tokio runtime with `--workers`
//! worker threads (1 when the bench pins the server to a CPU).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};

/// A failure, told on stderr.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The command line: `--store memory|postgres://...`, `--workers N`, `--pool N`.
pub struct Options {
    pub store: String,
    pub workers: usize,
    pub pool: u32,
}

impl Options {
    pub fn from_args() -> Result<Self, BoxError> {
        let mut options = Self {
            store: "memory".to_owned(),
            workers: 1,
            pool: 10,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = || args.next().ok_or_else(|| format!("{arg} takes a value"));
            match arg.as_str() {
                "--store" => options.store = value()?,
                "--workers" => options.workers = value()?.parse()?,
                "--pool" => options.pool = value()?.parse()?,
                other => {
                    return Err(format!("takes --store, --workers and --pool, not {other}").into());
                }
            }
        }
        Ok(options)
    }
}

/// Times the handler ran, on any route.
static EXECUTIONS: AtomicU64 = AtomicU64::new(0);

/// The bench's trivial handler.
pub async fn charge(body: Bytes) -> impl IntoResponse {
    EXECUTIONS.fetch_add(1, Ordering::Relaxed);
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        format!(
            r#"{{"id":"ch_bench","status":"succeeded","received":{}}}"#,
            body.len()
        ),
    )
}

/// The same handler after 100 ms of waiting, as on a payment provider: the
/// duplicates check sends its requests here, so that they overlap.
pub async fn slow_charge(body: Bytes) -> impl IntoResponse {
    tokio::time::sleep(Duration::from_millis(100)).await;
    charge(body).await
}

/// `POST /layered` and `POST /layered-slow`, for the peer to put behind its
/// middleware.
pub fn routes() -> Router {
    Router::new()
        .route("/layered", post(charge))
        .route("/layered-slow", post(slow_charge))
}

/// Adds `GET /executions` (the handler's run count, as text) to `layered`, and
/// serves it on 127.0.0.1 and a free port, announced first on stdout as
/// `listening on http://HOST:PORT`.
pub fn serve<F>(options: &Options, build: impl FnOnce() -> F) -> Result<(), BoxError>
where
    F: Future<Output = Result<Router, BoxError>>,
{
    use std::io::Write;

    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.workers.max(1))
        .enable_all()
        .build()?
        .block_on(async {
            let app = build().await?.route(
                "/executions",
                get(|| async { EXECUTIONS.load(Ordering::Relaxed).to_string() }),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            {
                let mut stdout = std::io::stdout().lock();
                writeln!(stdout, "listening on http://{}", listener.local_addr()?)?;
                stdout.flush()?;
            }
            axum::serve(listener, app).await?;
            Ok(())
        })
}

/// Runs `main`, telling a failure on stderr.
pub fn exit(result: Result<(), BoxError>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{error}");
            std::process::ExitCode::FAILURE
        }
    }
}
