//! The demo against a real PostgreSQL (a throwaway cluster): the consumer
//! without the inbox ends with a wrong balance, the one with it with the exact
//! balance, run after run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use consumer::{Report, Tally};
use idem_core::retry::Backoff;
use idem_testkit::TestPostgres;

#[test]
fn the_inbox_makes_the_balance_exact_where_redeliveries_break_it() {
    let cluster = TestPostgres::start().expect("a PostgreSQL test cluster");
    cluster.create_database("demo").unwrap();
    let url = cluster.url("demo");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    // The binary retries after Backoff::for_consumers(); the test keeps the same
    // full-jitter policy on a millisecond scale.
    let backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(10));
    let expected = Report {
        deliveries: 11,
        expected: 100 + 250 + 40 - 30 + 75 + 10,
        without_inbox: 100 + 3 * 250 + 2 * 40 - 2 * 30 + 500 + 75 + 10,
        with_inbox: 445,
        inbox: Tally {
            processed: 6,
            duplicates: 4,
            refused: 1,
            retries: 1,
        },
    };
    for _ in 0..2 {
        let report = runtime.block_on(consumer::run(&url, backoff)).unwrap();
        assert_eq!(report, expected, "each run sees only its own deliveries");
    }
    let lines = expected.lines();
    assert_eq!(
        lines[1],
        "without the inbox: balance 1455, expected 445: WRONG (every delivery applied)"
    );
    assert_eq!(
        lines[2],
        "with the inbox:    balance 445, expected 445: exact (6 processed, 4 duplicates skipped, \
         1 refused without an id, 1 failed attempts retried)"
    );
    drop(runtime);
    drop(cluster);
}
