//! Two principals, one key: two scopes, two records, two effects.

use std::sync::Arc;

use super::{Checks, unique};
use crate::e2e::api::{Call, Failure, Outcome};
use crate::e2e::site::Deployment;

pub(super) const CHECK: &str = "two principals, one key → 2 effects";

pub(super) async fn run(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("scopes").await?;
    let instance = site.start(&[]).await?;
    let api = &instance.api;
    let (alice, bob) = (&unique("alice"), &unique("bob"));
    let account = &unique("shared");
    let by_alice = Call::charge(alice, account, &unique("key"), 100);
    let by_bob = by_alice.clone().by(bob);
    let outcome: Outcome = async {
        let first_alice = api.send(&by_alice).await?;
        let first_bob = api.send(&by_bob).await?;
        for (call, answer) in [(&by_alice, &first_alice), (&by_bob, &first_bob)] {
            if answer.status != 201 || answer.replayed() {
                return Err(Failure::unexpected(
                    call,
                    "201, not replayed (another principal's record is not this one's)",
                    answer,
                ));
            }
        }
        let id = |answer: &crate::e2e::api::Answer| answer.json().unwrap_or_default()["id"].clone();
        if id(&first_alice) == id(&first_bob) {
            return Err(Failure::unexpected(
                &by_bob,
                format!("a charge id other than alice's {}", id(&first_alice)),
                &first_bob,
            ));
        }
        // Each retry replays its own principal's answer, never the other's.
        for (call, first) in [(&by_alice, &first_alice), (&by_bob, &first_bob)] {
            let again = api.send(call).await?;
            again
                .replays(first)
                .map_err(|why| Failure::wrong(call, "the replay of this principal's own answer", &again, &why))?;
        }
        let seen_by_alice = api.account(alice, account).await?;
        let seen_by_bob = api.account(bob, account).await?;
        Ok(format!(
            "2 effects (ids differ), each retry replays its own; account shows {} and {} operations",
            seen_by_alice.operations, seen_by_bob.operations
        ))
    }
    .await;
    Ok(vec![(CHECK, outcome)])
}
