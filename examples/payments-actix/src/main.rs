//! `payments-actix`: the payments service on actix-web. See `--help`.

use std::io::Write;
use std::process::ExitCode;

use actix_web::HttpServer;
use idem_actix::idem_core::log::error_chain;
use payments::{Options, Payments, StartError, Storage, init_tracing, listening_line};

/// Why the service stopped.
#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("the server failed")]
    Io(#[from] std::io::Error),
}

fn main() -> ExitCode {
    init_tracing();
    let options = Options::from_command_line();
    match actix_web::rt::System::new().block_on(serve(options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let message = format!("payments-actix: {}", error_chain(&error));
            eprintln!("{message}");
            match &error {
                // 2: a command line that can never work (`--publish` without
                // transactions), as `docs/contract.md` §11 asks.
                ServeError::Start(start) => ExitCode::from(start.exit_code()),
                ServeError::Io(_) => ExitCode::FAILURE,
            }
        }
    }
}

/// Opens the store, binds, prints the listening line, and serves until Ctrl-C.
async fn serve(options: Options) -> Result<(), ServeError> {
    let Storage { guards, ledger } = options.open().await?;
    let listener = options.bind()?;
    let addr = listener.local_addr()?;
    let guards = guards.lease(options.lease());
    let payments = Payments::with_provider(ledger, options.provider()?);
    let server = HttpServer::new(move || payments_actix::app(guards.clone(), payments.clone()))
        .listen(listener)?
        .run();
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{}", listening_line(addr))?;
        stdout.flush()?;
    }
    server.await?;
    Ok(())
}
