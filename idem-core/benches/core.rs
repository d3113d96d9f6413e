//! Benchmarks of the per-request work idem-core adds: the fingerprint of a body, and
//! a claim and a completion on the in-memory store.
//!
//! `cargo bench -p idem-core --bench core`

// A benchmark that cannot set up has nothing to measure: failing loudly is right.
#![allow(clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use idem_core::store::{ClaimOutcome, ClaimRequest, OwnerToken};
use idem_core::{
    Fingerprint, FingerprintSpec, Header, HeaderSource, IdempotencyKey, MemoryStore, RequestHead,
    Scope, Store, StoredResponse,
};

/// The size of the chunks a body streams in, as hyper commonly delivers them.
const CHUNK: usize = 16 * 1024;

/// A JSON request's headers.
struct JsonHeaders;

impl HeaderSource for JsonHeaders {
    fn each_field<'a>(&'a self, name: &str, each: &mut dyn FnMut(&'a [u8])) {
        if name == "content-type" {
            each(b"application/json");
        }
    }
}

fn fingerprint(c: &mut Criterion) {
    let spec = FingerprintSpec::default();
    let head = RequestHead {
        method: "POST",
        path: "/accounts/a1/charges",
        query: "",
        headers: &JsonHeaders,
    };
    let mut group = c.benchmark_group("fingerprint");
    for (name, len) in [("exact_1KiB", 1024), ("exact_1MiB", 1024 * 1024)] {
        let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                let mut builder = spec.start(black_box(&head));
                for chunk in black_box(&body).chunks(CHUNK) {
                    builder.update(chunk);
                }
                builder.finish()
            });
        });
    }
    group.finish();
}

fn memory_store(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a Tokio runtime");
    let store = MemoryStore::new();
    let scope = Scope::new("merchant-1");
    let fingerprint = Fingerprint::from_bytes([7; 32]);
    let response = StoredResponse::new(
        201,
        vec![
            Header::new("content-type", "application/json"),
            Header::new("location", "/charges/ch_1"),
        ],
        r#"{"id":"ch_1","amount":100,"currency":"EUR","balance":100}"#,
    );
    let mut next = 0u64;

    let mut group = c.benchmark_group("memory_store");
    group.bench_function("claim_complete_fresh_key", |b| {
        b.iter_batched(
            // Unique keys, built outside the measurement.
            || {
                next += 1;
                ClaimRequest {
                    scope: scope.clone(),
                    key: IdempotencyKey::new(&format!("bench-{next}")).expect("a valid key"),
                    fingerprint,
                    owner: OwnerToken::random(),
                    lease: Duration::from_secs(30),
                    retention: Duration::from_secs(24 * 60 * 60),
                }
            },
            |request| {
                runtime.block_on(async {
                    let ClaimOutcome::Claimed(claim) =
                        store.claim(&request).await.expect("the claim")
                    else {
                        panic!("a fresh key is claimed");
                    };
                    store
                        .complete(&claim, &response, request.retention)
                        .await
                        .expect("the completion");
                });
            },
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

criterion_group!(benches, fingerprint, memory_store);
criterion_main!(benches);
