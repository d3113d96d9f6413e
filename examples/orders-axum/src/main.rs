//! `orders-axum [--listen ADDR] [--database sqlite://PATH] [--publish URL]
//! [--publish-to NAME] [--lease-secs N]`: the orders API
//! (see the library's docs), served until Ctrl-C or SIGTERM.
//!
//! Prints `listening on http://ADDR` first on stdout (port 0 picks a free
//! port); logs go to stderr, filtered by `RUST_LOG` (default `info`).

use std::process::ExitCode;

use orders_axum::start::{self, CleanupJob, Options, StartError};

#[tokio::main]
async fn main() -> ExitCode {
    start::init_tracing();
    start::exit_code("orders-axum", serve().await)
}

async fn serve() -> Result<(), StartError> {
    let options = Options::from_args()?;
    let (store, orders) = start::open(&options).await?;
    let cleanup = CleanupJob::spawn(&store);
    let listener = tokio::net::TcpListener::bind(&options.listen).await?;
    start::print_listening(listener.local_addr()?)?;
    let app = orders_axum::app(&store, orders, options.lease)?;
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    cleanup.stop().await
}

/// Resolves on Ctrl-C or SIGTERM; in-flight requests then finish.
async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut terminate) => drop(terminate.recv().await),
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}
