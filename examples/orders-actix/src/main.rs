//! `orders-actix [--listen ADDR] [--database sqlite://PATH]`: the orders API
//! (see the library's docs), served until Ctrl-C or SIGTERM.
//!
//! Prints `listening on http://ADDR` first on stdout (port 0 picks a free
//! port); logs go to stderr, filtered by `RUST_LOG` (default `info`).

use std::error::Error;
use std::io::Write;
use std::process::ExitCode;

use actix_web::{App, HttpServer};
use idem_diesel::SqliteStore;
use orders_actix::{Orders, routes};
use tracing_subscriber::EnvFilter;

#[actix_web::main]
async fn main() -> ExitCode {
    // Without a subscriber, the cause of a `503 store-unavailable` is nowhere.
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    match serve().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let mut message = format!("orders-actix: {error}");
            let mut source = error.source();
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}

async fn serve() -> Result<(), Box<dyn Error + Send + Sync>> {
    let (listen, database) = options()?;

    // The records survive restarts in this file; `migrate` creates or upgrades
    // their table (forgetting it answers every keyed request `503`).
    let store = SqliteStore::connect(&database).await?;
    store.migrate().await?;
    let orders = Orders::open(store.pool().clone()).await?;

    // Deletes expired records (24 h after completion by default), one batch
    // at a time, until told to stop.
    let (stop_cleanup, cleanup_stopped) = tokio::sync::oneshot::channel::<()>();
    let cleanup = tokio::spawn(store.cleanup().run(async {
        let _ = cleanup_stopped.await;
    }));

    let listener = std::net::TcpListener::bind(&listen)?;
    let addr = listener.local_addr()?;
    let routes = routes(store, orders);
    // actix-web stops on Ctrl-C and SIGTERM by itself, letting in-flight
    // requests finish.
    let server = HttpServer::new(move || App::new().configure(routes.clone()))
        .listen(listener)?
        .run();
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on http://{addr}")?;
    stdout.flush()?;
    drop(stdout);

    server.await?;
    let _ = stop_cleanup.send(());
    let deleted = cleanup.await?;
    tracing::info!(deleted, "stopped");
    Ok(())
}

/// `--listen ADDR` (default `127.0.0.1:3000`) and `--database URL` (default
/// `sqlite://orders.db`).
fn options() -> Result<(String, String), String> {
    let (mut listen, mut database) = ("127.0.0.1:3000".to_owned(), "sqlite://orders.db".to_owned());
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let target = match flag.as_str() {
            "--listen" => &mut listen,
            "--database" => &mut database,
            _ => {
                return Err(format!(
                    "unknown argument {flag:?}: expected --listen or --database"
                ));
            }
        };
        *target = args.next().ok_or(format!("{flag} needs a value"))?;
    }
    Ok((listen, database))
}
