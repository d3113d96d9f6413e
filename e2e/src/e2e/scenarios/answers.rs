//! The answers of `docs/contract.md` §4 and §5 that one idle server can show, each on
//! an account of its own.

use std::sync::Arc;

use serde_json::json;

use super::{Checks, unique};
use crate::e2e::api::{Answer, Api, Call, Failure, Outcome, effects, expect_account};
use crate::e2e::site::Deployment;

const FIRST: &str = "first charge → 201";
const REPLAY: &str = "replay → identical answer";
const KEY_FORMS: &str = "sf string, bare token, 255 chars → accepted";
const REUSED: &str = "same key, other body → 422 key-reused";
const TOO_LARGE: &str = "body over 1 MiB → 413";
const MALFORMED: &str = "malformed keys → 400 invalid-key";
const MISSING: &str = "charge without key → 400 missing-key";
const UNAUTHENTICATED: &str = "no bearer → 401";
const INVALID_BODY: &str = "invalid body → 400";
const STORED_4XX: &str = "a 4xx is stored → replayed";
const OPTIONAL: &str = "deposit (key optional) → passes through";

pub(super) const CHECKS: &[&str] = &[
    FIRST,
    REPLAY,
    KEY_FORMS,
    REUSED,
    TOO_LARGE,
    MALFORMED,
    MISSING,
    UNAUTHENTICATED,
    INVALID_BODY,
    STORED_4XX,
    OPTIONAL,
];

/// The default request body limit (`docs/contract.md` §4).
const BODY_LIMIT: usize = 1024 * 1024;

pub(super) async fn run(deployment: Arc<Deployment>) -> Result<Checks, Failure> {
    let site = deployment.site("answers").await?;
    let instance = site.start(&[]).await?;
    let api = &instance.api;
    let principal = &unique("alice");

    let account = unique("first");
    let call = Call::charge(principal, &account, &unique("key"), 100);
    let first = api.send(&call).await;
    let first_outcome = match &first {
        Ok(answer) => first_charge(api, principal, &account, &call, answer).await,
        Err(failure) => Err(failure.clone()),
    };
    let replay_outcome = match (&first, &first_outcome) {
        (Ok(answer), Ok(_)) => replay(api, principal, &account, &call, answer).await,
        _ => Err(Failure::new(
            "needs the first charge",
            "the first charge failed (row above)",
        )),
    };
    Ok(vec![
        (FIRST, first_outcome),
        (REPLAY, replay_outcome),
        (KEY_FORMS, key_forms(api, principal).await),
        (REUSED, reused(api, principal).await),
        (TOO_LARGE, too_large(api, principal).await),
        (MALFORMED, malformed(api, principal).await),
        (MISSING, missing(api, principal).await),
        (UNAUTHENTICATED, unauthenticated(api, principal).await),
        (INVALID_BODY, invalid_body(api, principal).await),
        (STORED_4XX, stored_4xx(api, principal).await),
        (OPTIONAL, optional(api, principal).await),
    ])
}

async fn first_charge(
    api: &Api,
    principal: &str,
    account: &str,
    call: &Call,
    first: &Answer,
) -> Outcome {
    let body = first.json().unwrap_or_default();
    let id_is_uuid = body["id"]
        .as_str()
        .is_some_and(|id| uuid::Uuid::parse_str(id).is_ok());
    let as_charged = body["account_id"] == account
        && body["amount"] == 100
        && body["currency"] == "EUR"
        && body["balance"] == 100;
    if first.status != 201 || first.replayed() || !id_is_uuid || !as_charged {
        return Err(Failure::unexpected(
            call,
            format!(
                "201, not replayed, {}",
                json!({"id": "UUID", "account_id": account, "amount": 100,
                       "currency": "EUR", "balance": 100})
            ),
            first,
        ));
    }
    expect_account(api, principal, account, effects(1, 100), "one charge").await?;
    Ok("201, balance 100, 1 operation".to_owned())
}

async fn replay(api: &Api, principal: &str, account: &str, call: &Call, first: &Answer) -> Outcome {
    let again = api.send(call).await?;
    again
        .replays(first)
        .map_err(|why| Failure::wrong(call, "a replay of the first answer", &again, &why))?;
    expect_account(
        api,
        principal,
        account,
        effects(1, 100),
        "a charge and its replay",
    )
    .await?;
    Ok(format!(
        "{} replayed, {}-byte body and {} headers identical, 1 operation",
        again.status,
        again.body.len(),
        again.headers.len()
    ))
}

async fn key_forms(api: &Api, principal: &str) -> Outcome {
    let account = unique("forms");
    let key = unique("form");
    let quoted = format!("\"{key}\"");
    let sf = Call::charge(principal, &account, &key, 100).keys(&[quoted.as_bytes()]);
    let first = api.send(&sf).await?;
    if first.status != 201 || first.replayed() {
        return Err(Failure::unexpected(&sf, "201, not replayed", &first));
    }
    // The key is the value as parsed: the sf string "k" and the token k are one key.
    let bare = sf.clone().keys(&[key.as_bytes()]);
    let second = api.send(&bare).await?;
    second.replays(&first).map_err(|why| {
        Failure::wrong(
            &bare,
            "the replay of the same key sent as an sf string",
            &second,
            &why,
        )
    })?;
    let longest: String = format!("{}{}", unique("max"), "k".repeat(255))
        .chars()
        .take(255)
        .collect();
    let long = Call::charge(principal, &account, &longest, 100);
    let third = api.send(&long).await?;
    if third.status != 201 || third.replayed() {
        return Err(Failure::unexpected(
            &long,
            "201 for a 255-character key",
            &third,
        ));
    }
    expect_account(
        api,
        principal,
        &account,
        effects(2, 200),
        "two distinct keys",
    )
    .await?;
    Ok("sf string 201, bare token → its replay, 255 chars 201".to_owned())
}

async fn reused(api: &Api, principal: &str) -> Outcome {
    let account = unique("reused");
    let key = unique("key");
    let call = Call::charge(principal, &account, &key, 100);
    let first = api.send(&call).await?;
    if first.status != 201 {
        return Err(Failure::unexpected(&call, "201", &first));
    }
    let other = Call::charge(principal, &account, &key, 200);
    let answer = api.send(&other).await?;
    answer
        .problem(422, Some("key-reused"))
        .map_err(|why| Failure::wrong(&other, "422 problem key-reused", &answer, &why))?;
    expect_account(api, principal, &account, effects(1, 100), "a reused key").await?;
    Ok("422 key-reused, 1 operation".to_owned())
}

async fn too_large(api: &Api, principal: &str) -> Outcome {
    let account = unique("large");
    let head = r#"{"amount":100,"currency":"EUR","note":""#;
    let tail = r#""}"#;
    let pad = "x".repeat(BODY_LIMIT + 1 - head.len() - tail.len());
    let body = format!("{head}{pad}{tail}");
    let call = Call::charge(principal, &account, &unique("key"), 100).body(body);
    // On a connection of its own: a server may close it without reading the
    // body, and the next request must not inherit that.
    let answer = api.alone()?.send(&call).await?;
    answer
        .problem(413, Some("payload-too-large"))
        .map_err(|why| Failure::wrong(&call, "413 problem payload-too-large", &answer, &why))?;
    expect_account(
        api,
        principal,
        &account,
        effects(0, 0),
        "a body over the limit",
    )
    .await?;
    Ok(format!(
        "413 payload-too-large for {} bytes",
        BODY_LIMIT + 1
    ))
}

async fn malformed(api: &Api, principal: &str) -> Outcome {
    let account = unique("malformed");
    let one = unique("one");
    let two = unique("two");
    let comma = format!("{one},{two}");
    let unterminated = format!("\"{one}");
    let control = format!("{one}\tx");
    let non_ascii = format!("{one}é");
    let too_long: String = format!("{one}{}", "k".repeat(256))
        .chars()
        .take(256)
        .collect();
    let kinds: [(&str, Vec<&[u8]>); 7] = [
        ("two header fields", vec![one.as_bytes(), two.as_bytes()]),
        ("a comma in a bare value", vec![comma.as_bytes()]),
        ("an empty value", vec![b""]),
        ("bad sf syntax (\"abc)", vec![unterminated.as_bytes()]),
        ("a control character (tab)", vec![control.as_bytes()]),
        ("a non-ASCII character", vec![non_ascii.as_bytes()]),
        ("256 characters", vec![too_long.as_bytes()]),
    ];
    let mut wrong = Vec::new();
    for (kind, keys) in &kinds {
        let call = Call::charge(principal, &account, "", 100).keys(keys);
        let answer = api.send(&call).await?;
        if let Err(why) = answer.problem(400, Some("invalid-key")) {
            wrong.push(
                Failure::wrong(&call, "400 problem invalid-key", &answer, &why).details_of(kind),
            );
        }
    }
    if !wrong.is_empty() {
        return Err(Failure::new(
            format!(
                "{}/{} kinds → 400 invalid-key",
                kinds.len() - wrong.len(),
                kinds.len()
            ),
            wrong.join("\n"),
        ));
    }
    expect_account(api, principal, &account, effects(0, 0), "malformed keys").await?;
    Ok(format!(
        "{0}/{0} kinds → 400 invalid-key, 0 operations",
        kinds.len()
    ))
}

async fn missing(api: &Api, principal: &str) -> Outcome {
    let account = unique("missing");
    let call = Call::charge(principal, &account, "", 100).keys(&[]);
    let answer = api.send(&call).await?;
    answer
        .problem(400, Some("missing-key"))
        .map_err(|why| Failure::wrong(&call, "400 problem missing-key", &answer, &why))?;
    expect_account(
        api,
        principal,
        &account,
        effects(0, 0),
        "a charge without key",
    )
    .await?;
    Ok("400 missing-key, 0 operations".to_owned())
}

async fn unauthenticated(api: &Api, principal: &str) -> Outcome {
    let account = unique("anonymous");
    let call = Call::charge(principal, &account, &unique("key"), 100).anonymous();
    let answer = api.send(&call).await?;
    answer
        .problem(401, None)
        .map_err(|why| Failure::wrong(&call, "401 problem", &answer, &why))?;
    expect_account(
        api,
        principal,
        &account,
        effects(0, 0),
        "a charge without bearer",
    )
    .await?;
    Ok("401 problem, 0 operations".to_owned())
}

async fn invalid_body(api: &Api, principal: &str) -> Outcome {
    let account = unique("invalid");
    let bodies = [
        ("not JSON", "amount=100".to_owned()),
        (
            "amount 0",
            json!({"amount": 0, "currency": "EUR"}).to_string(),
        ),
        (
            "a negative amount",
            json!({"amount": -5, "currency": "EUR"}).to_string(),
        ),
        (
            "a fractional amount",
            json!({"amount": 1.5, "currency": "EUR"}).to_string(),
        ),
        (
            "an amount as a string",
            json!({"amount": "100", "currency": "EUR"}).to_string(),
        ),
        ("no currency", json!({"amount": 100}).to_string()),
    ];
    let mut wrong = Vec::new();
    for (kind, body) in &bodies {
        let call = Call::charge(principal, &account, &unique("key"), 100).body(body.clone());
        let answer = api.send(&call).await?;
        if let Err(why) = answer.problem(400, None) {
            wrong.push(Failure::wrong(&call, "400 problem", &answer, &why).details_of(kind));
        }
    }
    if !wrong.is_empty() {
        return Err(Failure::new(
            format!(
                "{}/{} bodies → 400",
                bodies.len() - wrong.len(),
                bodies.len()
            ),
            wrong.join("\n"),
        ));
    }
    expect_account(api, principal, &account, effects(0, 0), "invalid bodies").await?;
    Ok(format!(
        "{0}/{0} bodies → 400 problem, 0 operations",
        bodies.len()
    ))
}

async fn stored_4xx(api: &Api, principal: &str) -> Outcome {
    let account = unique("stored");
    let call = Call::charge(principal, &account, &unique("key"), 100)
        .body(json!({"amount": 0, "currency": "EUR"}).to_string());
    let first = api.send(&call).await?;
    if first.status != 400 || first.replayed() {
        return Err(Failure::unexpected(&call, "400, not replayed", &first));
    }
    let again = api.send(&call).await?;
    again.replays(&first).map_err(|why| {
        Failure::wrong(
            &call,
            "the replay of the stored 400 (docs/contract.md §5)",
            &again,
            &why,
        )
    })?;
    Ok("400 stored, retry replayed byte for byte".to_owned())
}

async fn optional(api: &Api, principal: &str) -> Outcome {
    let account = unique("deposits");
    let call = Call::deposit(principal, &account, 100);
    for _ in 0..2 {
        let answer = api.send(&call).await?;
        if answer.status != 201 || answer.replayed() {
            return Err(Failure::unexpected(&call, "201, not replayed", &answer));
        }
    }
    expect_account(
        api,
        principal,
        &account,
        effects(2, 200),
        "a deposit delivered twice without key",
    )
    .await?;
    let keyed = call.keys(&[unique("key").as_bytes()]);
    let first = api.send(&keyed).await?;
    let again = api.send(&keyed).await?;
    if first.status != 201 {
        return Err(Failure::unexpected(&keyed, "201", &first));
    }
    again
        .replays(&first)
        .map_err(|why| Failure::wrong(&keyed, "a replay of the keyed deposit", &again, &why))?;
    expect_account(
        api,
        principal,
        &account,
        effects(3, 300),
        "a keyed deposit delivered twice",
    )
    .await?;
    Ok("2 deliveries without key → 2 operations; with a key → replay".to_owned())
}
