//! `orders-actix [--listen ADDR] [--database sqlite://PATH] [--publish URL]
//! [--publish-to NAME] [--lease-secs N]`: the orders API
//! (see the library's docs), served until Ctrl-C or SIGTERM.
//!
//! Prints `listening on http://ADDR` first on stdout (port 0 picks a free
//! port); logs go to stderr, filtered by `RUST_LOG` (default `info`).

use std::process::ExitCode;

use actix_web::{App, HttpServer};
use orders_actix::start::{self, CleanupJob, Options, StartError};

#[actix_web::main]
async fn main() -> ExitCode {
    start::init_tracing();
    start::exit_code("orders-actix", serve().await)
}

async fn serve() -> Result<(), StartError> {
    let options = Options::from_args()?;
    let (store, orders) = start::open(&options).await?;
    let cleanup = CleanupJob::spawn(&store);
    let listener = std::net::TcpListener::bind(&options.listen)?;
    let addr = listener.local_addr()?;
    let routes = orders_actix::routes(&store, orders, options.lease)?;
    // actix-web stops on Ctrl-C and SIGTERM by itself, letting in-flight
    // requests finish.
    let server = HttpServer::new(move || App::new().configure(routes.clone()))
        .listen(listener)?
        .run();
    start::print_listening(addr)?;
    server.await?;
    cleanup.stop().await
}
