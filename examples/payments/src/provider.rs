//! The payment provider a charge calls before it applies: simulated in this
//! process, or a real HTTP endpoint (`--provider-url`).

use std::time::Duration;

use idem_client::IdempotentRetry;
use idem_client::reqwest_middleware::{self, ClientBuilder, ClientWithMiddleware};
use idem_core::retry::RetryPolicy;
use idem_core::{IdempotencyKey, Scope};
use serde::Serialize;

use crate::service::hex_digest;
use crate::{Attempt, OperationRequest};

/// How long a charge waits for the provider's answer before it gives up.
pub const PROVIDER_TIMEOUT: Duration = Duration::from_secs(10);

/// What the provider's idempotency key is hashed over, before the scope and
/// the key.
const FORWARDED_KEY_CONTEXT: &[u8] = b"payments provider key v1\n";

/// The payment provider behind `POST /accounts/{account_id}/charges`.
///
/// - [`Provider::simulated`] (the default, `--provider-latency-ms`): waits,
///   then accepts every charge.
/// - [`Provider::http`] (`--provider-url URL`): `POST {URL}/payments` with
///   the JSON body `{"account_id", "amount", "currency"}` and an
///   `Idempotency-Key` header, [`forwarded_key`] of the request's scope and
///   key: the same on every retry of one charge, different between principals
///   and keys, so the provider recognises a retry after a crash. A `2xx`
///   answer lets the charge proceed; anything else (another status, a refused
///   connection, no answer within [`PROVIDER_TIMEOUT`]) fails the charge with
///   `502` before anything is applied, and since idem stores no `5xx`, the
///   record is released and a retry calls the provider again. The URL is
///   called directly (no proxy), over plain HTTP.
///
/// The call goes through [`idem_client::IdempotentRetry`] with no retries of
/// its own: the contract answers the charge `502` on the provider's first
/// failure (docs/contract.md §8), so the retry is the charge's, by its client,
/// with the same forwarded key. What the middleware brings is the deadline
/// ([`PROVIDER_TIMEOUT`] bounds the call, not each read), its attempt span
/// and its metrics (`idem_client_attempts_total`), and one place to turn on
/// retries should a provider's contract allow them.
///
/// In transactional mode (PostgreSQL) the call happens inside the request's
/// transaction, after the claim: see [`TransactionalPgStore`]'s slow handlers
/// for why a provider slower than the lease is still called once.
///
/// [`TransactionalPgStore`]: idem_diesel::TransactionalPgStore
///
/// ```
/// use std::time::Duration;
/// use payments::Provider;
///
/// assert!(Provider::http("http://127.0.0.1:8080").is_ok());
/// assert!(Provider::http("ftp://example.com").is_err());
/// let _simulated = Provider::simulated(Duration::from_millis(20));
/// ```
#[derive(Clone, Debug)]
pub struct Provider {
    backend: Backend,
}

#[derive(Clone, Debug)]
enum Backend {
    Simulated {
        latency: Duration,
    },
    Http {
        payments: String,
        client: ClientWithMiddleware,
    },
}

/// Why the provider did not accept a charge.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// No answer: refused, broken, or past [`PROVIDER_TIMEOUT`].
    #[error("the payment provider did not answer")]
    Unreachable(#[source] reqwest_middleware::Error),
    /// An answer other than `2xx`.
    #[error("the payment provider answered {0}")]
    Declined(u16),
}

/// The provider URL is not an `http://` URL.
#[derive(Debug, thiserror::Error)]
#[error("the provider URL must start with http://, not {0:?}")]
pub struct InvalidProviderUrl(String);

/// The body of `POST {URL}/payments`.
#[derive(Serialize)]
struct PaymentBody<'a> {
    account_id: &'a str,
    amount: i64,
    currency: &'a str,
}

impl Provider {
    /// The in-process provider: accepts every charge after `latency`.
    pub fn simulated(latency: Duration) -> Self {
        Self {
            backend: Backend::Simulated { latency },
        }
    }

    /// The provider at `url` (`http://HOST:PORT`, optionally with a path
    /// prefix): charges go to `{url}/payments`.
    pub fn http(url: &str) -> Result<Self, InvalidProviderUrl> {
        if !url.starts_with("http://") {
            return Err(InvalidProviderUrl(url.to_owned()));
        }
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|_| InvalidProviderUrl(url.to_owned()))?;
        let calls = IdempotentRetry::new()
            .policy(RetryPolicy::default().max_retries(0))
            .without_budget()
            .deadline(PROVIDER_TIMEOUT);
        let client = ClientBuilder::new(http).with(calls).build();
        Ok(Self {
            backend: Backend::Http {
                payments: format!("{}/payments", url.trim_end_matches('/')),
                client,
            },
        })
    }

    /// Asks the provider to take the charge.
    pub(crate) async fn charge(
        &self,
        account_id: &str,
        request: &OperationRequest,
        attempt: &Attempt,
    ) -> Result<(), ProviderError> {
        let (payments, client) = match &self.backend {
            Backend::Simulated { latency } => {
                tokio::time::sleep(*latency).await;
                return Ok(());
            }
            Backend::Http { payments, client } => (payments, client),
        };
        // An unkeyed charge (only possible through the library: the route
        // requires a key) is a new payment each time.
        let key = match attempt.key() {
            Some((scope, key)) => forwarded_key(scope, key),
            None => uuid::Uuid::new_v4().simple().to_string(),
        };
        let body = PaymentBody {
            account_id,
            amount: request.amount,
            currency: &request.currency,
        };
        let answer = client
            .post(payments)
            .header("idempotency-key", key)
            .json(&body)
            .send()
            .await
            .map_err(ProviderError::Unreachable)?;
        let status = answer.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(ProviderError::Declined(status.as_u16()))
        }
    }
}

/// The `Idempotency-Key` a charge forwards to the provider: 32 hex digits of
/// the SHA-256 of the request's scope and key (after a context string). The
/// same for every retry of one charge; different between principals and keys;
/// and it gives back neither the scope nor the key.
///
/// ```
/// use idem_core::{IdempotencyKey, Scope};
/// use payments::forwarded_key;
///
/// let key = IdempotencyKey::new("order-1")?;
/// let alice = forwarded_key(&Scope::new("alice"), &key);
/// assert_eq!(alice.len(), 32);
/// assert_eq!(alice, forwarded_key(&Scope::new("alice"), &key));
/// assert_ne!(alice, forwarded_key(&Scope::new("bob"), &key));
/// assert_ne!(alice, forwarded_key(&Scope::new("alice"), &IdempotencyKey::new("order-2")?));
/// # Ok::<(), idem_core::KeyError>(())
/// ```
pub fn forwarded_key(scope: &Scope, key: &IdempotencyKey) -> String {
    // A newline separates them: keys are printable ASCII, so no key holds one.
    hex_digest(&[
        FORWARDED_KEY_CONTEXT,
        scope.as_str().as_bytes(),
        b"\n",
        key.as_str().as_bytes(),
    ])
}
