#![doc = include_str!("../README.md")]

mod app;
mod cases;
mod client;
pub mod durable;
mod failing_store;
mod hands_a_till;
pub mod stores;
mod target;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use idem_core::{MemoryStore, Store};

pub use app::{
    ANONYMOUS, CHUNK_BYTES, LIMITED_BYTES, ScenarioAnswer, ScenarioApp, ScenarioRequest,
    ScenarioRoute, pattern, principal, routes,
};
pub use failing_store::{FAILING_STORE_SECRET, FailingStore};
pub use hands_a_till::{HandsATill, PromisesATill, Till, assert_route_misconfigured};
pub use target::{RECEIVE_BUFFER, Target, bind};

/// The future of one case.
pub type CaseFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One scenario: a name (also the name of its generated test) and what it does
/// with a running app. It panics when the app misbehaves.
#[derive(Clone, Copy)]
pub struct Case {
    /// The case's name, e.g. `replay_is_byte_identical`.
    pub name: &'static str,
    /// Which store the app of this case is started over.
    pub store: CaseStore,
    /// Runs the case against the app.
    pub run: fn(Target) -> CaseFuture,
}

/// The store a case's app is started over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaseStore {
    /// A fresh store of the kind under test (the in-memory store, or the one the
    /// test file names).
    UnderTest,
    /// A [`FailingStore`]: every step fails.
    Failing,
    /// A [`MemoryStore`] with room for [`FULL_STORE_RECORDS`] records: full
    /// once they are taken.
    Full,
}

/// How many records the [`CaseStore::Full`] store holds.
pub const FULL_STORE_RECORDS: usize = 2;

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("name", &self.name)
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

/// Every case of the suite.
///
/// ```
/// let cases = idem_http_suite::cases();
/// assert!(cases.iter().any(|case| case.name == "replay_is_byte_identical"));
/// ```
pub fn cases() -> Vec<Case> {
    scenario_tests!(@cases [list])
}

/// A fresh in-memory store: the store of [`scenario_tests!`] when the test file
/// names none.
pub async fn memory_store() -> Arc<dyn Store> {
    Arc::new(MemoryStore::new())
}

/// Runs the case named `name`: starts a fresh app with `start` over the store the
/// case asks for (a fresh one from `store`, or a [`FailingStore`]), runs the
/// case, and drops the app. [`scenario_tests!`] calls it once per test.
///
/// # Panics
///
/// When the case fails, or when no case is named `name`.
pub async fn run_case<Start, Started, Fresh, Stored>(name: &str, start: Start, store: Fresh)
where
    Start: FnOnce(Arc<dyn Store>) -> Started,
    Started: Future<Output = Target>,
    Fresh: FnOnce() -> Stored,
    Stored: Future<Output = Arc<dyn Store>>,
{
    let Some(case) = cases().into_iter().find(|case| case.name == name) else {
        panic!("the scenario suite has no case named {name}");
    };
    let store = match case.store {
        CaseStore::UnderTest => store().await,
        CaseStore::Failing => Arc::new(FailingStore),
        CaseStore::Full => Arc::new(
            MemoryStore::builder()
                .max_records(FULL_STORE_RECORDS)
                .build(),
        ),
    };
    let target = start(store).await;
    (case.run)(target).await;
}

/// Generates one `#[tokio::test]` per case of the suite.
///
/// `scenario_tests!(start)` runs every case against the app `start` builds over a
/// fresh [`MemoryStore`]; `scenario_tests!(start, store = fresh_store)` over the
/// store `fresh_store` makes (`async fn() -> Arc<dyn Store>`, called once per
/// case). `start` is an `async fn(Arc<dyn Store>) -> Target` that starts the
/// scenario app on 127.0.0.1 port 0.
///
/// The tests are generated where the macro is invoked, named after the cases; the
/// calling crate needs `tokio` (features `macros`, `rt-multi-thread`) among its
/// dev-dependencies.
#[macro_export]
macro_rules! scenario_tests {
    // The one list of cases: name and store.
    (@cases [$($mode:tt)*]) => {
        // Braces: the expansion is items in a test file, an expression in `cases`.
        $crate::scenario_tests!{@emit [$($mode)*]
            first_request_runs_the_handler: UnderTest,
            replay_is_byte_identical: UnderTest,
            repeated_set_cookie_headers_replay_intact: UnderTest,
            different_request_with_the_same_key_is_key_reused: UnderTest,
            stored_statuses_replay: UnderTest,
            released_statuses_run_again: UnderTest,
            panicking_handler_is_a_500_problem_and_runs_again: UnderTest,
            request_body_over_the_limit_is_rejected: UnderTest,
            streamed_request_body_is_forwarded_intact: UnderTest,
            response_over_the_stored_body_limit_is_sent_but_not_replayed: UnderTest,
            malformed_keys_are_invalid: UnderTest,
            valid_key_forms_name_the_same_record: UnderTest,
            missing_required_key_is_rejected: UnderTest,
            optional_route_without_key_runs_every_time: UnderTest,
            uncovered_methods_pass_through: UnderTest,
            in_progress_is_a_conflict_with_retry_after: UnderTest,
            wait_mode_waits_then_replays: UnderTest,
            wait_past_its_bound_is_a_conflict: UnderTest,
            concurrent_requests_with_one_key_execute_once: UnderTest,
            concurrent_requests_in_wait_mode_get_one_answer: UnderTest,
            client_disconnect_does_not_cancel_the_handler: UnderTest,
            handler_slower_than_its_lease_runs_once: UnderTest,
            scopes_are_isolated: UnderTest,
            oversized_body_is_answered_413_not_reset: UnderTest,
            refused_body_is_read_within_its_bound_then_closed: UnderTest,
            broken_request_body_is_400_body_unreadable: UnderTest,
            stalled_request_body_is_408_body_timeout: UnderTest,
            failing_store_fails_closed: Failing,
            unguarded_panicking_handler_is_a_500_problem: Failing,
            full_memory_store_fails_closed_and_keeps_its_replays: Full,
        }
    };
    (@emit [list] $($case:ident: $store:ident,)*) => {
        ::std::vec![$(
            $crate::Case {
                name: ::std::stringify!($case),
                store: $crate::CaseStore::$store,
                run: |target| ::std::boxed::Box::pin($crate::cases::$case(target)),
            },
        )*]
    };
    (@emit [tests $start:path, $fresh:path] $($case:ident: $store:ident,)*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::run_case(::std::stringify!($case), $start, $fresh).await;
            }
        )*
    };
    ($start:path, store = $fresh:path $(,)?) => {
        $crate::scenario_tests!(@cases [tests $start, $fresh]);
    };
    ($start:path $(,)?) => {
        $crate::scenario_tests!(@cases [tests $start, $crate::memory_store]);
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names_are_distinct_test_names() {
        let cases = cases();
        let mut names: Vec<_> = cases.iter().map(|case| case.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), cases.len());
        assert!(names.iter().all(|name| {
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        }));
        assert_eq!(
            cases
                .iter()
                .filter(|case| case.store == CaseStore::Failing)
                .count(),
            2
        );
    }
}
