//! `payments-axum`: the payments service on axum. See `--help`.

use std::io::Write;
use std::process::ExitCode;

use idem_core::log::error_chain;
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
    let served = tokio::runtime::Runtime::new()
        .map_err(ServeError::from)
        .and_then(|runtime| runtime.block_on(serve(options)));
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let message = format!("payments-axum: {}", error_chain(&error));
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

async fn serve(options: Options) -> Result<(), ServeError> {
    let Storage { guards, ledger } = options.open().await?;
    let listener = tokio::net::TcpListener::from_std(options.bind()?)?;
    let guards = guards.lease(options.lease());
    let payments = Payments::with_provider(ledger, options.provider()?);
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{}", listening_line(listener.local_addr()?))?;
        stdout.flush()?;
    }
    axum::serve(listener, payments_axum::app(guards, payments))
        .with_graceful_shutdown(async {
            // Without a signal handler the server runs until it is killed.
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        })
        .await?;
    Ok(())
}
