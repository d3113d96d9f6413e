//! payments-actix as a process, on every store: the routes and flags, and on
//! PostgreSQL the crash test (`SIGKILL` while charges are in flight; each
//! charge takes effect exactly once), transactional mode's duplicates and a
//! restart. The trials are `payments_harness`'s (`e2e/payments-harness`),
//! shared with payments-axum.

fn main() -> std::process::ExitCode {
    payments_harness::run(env!("CARGO_BIN_EXE_payments-actix"))
}
