//! The same retries for Tower clients (hyper's, tonic's, any
//! `Service<http::Request<B>>`): [`IdempotentRetryLayer`].

use std::task::{Context, Poll};
use std::time::Instant;

use http::HeaderValue;
use idem_core::KEY_HEADER;
use idem_core::retry::Attempt;
use tower::retry::{Policy, Retry};
use tower::{Layer, Service};

use crate::{Attempts, IdempotentRetry, retry_after};

/// A Tower layer that retries as [`IdempotentRetry`] does, key, policy,
/// deadline and budget included, around any service of `http::Request<B>`
/// whose body `B` can be cloned (a buffered body: `String`, `Bytes`,
/// `http_body_util::Full`). The [`Attempts`] sent are in the answer's
/// extensions.
///
/// ```
/// use std::convert::Infallible;
/// use idem_client::{IdempotentRetry, IdempotentRetryLayer};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let server = service_fn(|request: http::Request<String>| async move {
///     assert!(request.headers().contains_key("idempotency-key"));
///     Ok::<_, Infallible>(http::Response::new(String::from("charged")))
/// });
/// let client = IdempotentRetryLayer::new(IdempotentRetry::new()).layer(server);
/// let answer = client
///     .oneshot(http::Request::post("/charges").body(String::from("amount=1")).unwrap())
///     .await
///     .unwrap();
/// assert_eq!(idem_client::attempts_of(answer.extensions()).map(|a| a.sent), Some(1));
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct IdempotentRetryLayer {
    retry: IdempotentRetry,
}

impl IdempotentRetryLayer {
    /// Retries as `retry` says.
    pub fn new(retry: IdempotentRetry) -> Self {
        Self { retry }
    }
}

impl<S> Layer<S> for IdempotentRetryLayer {
    type Service = MintKey<Retry<TowerPolicy, S>>;

    fn layer(&self, inner: S) -> Self::Service {
        MintKey {
            retry: self.retry.clone(),
            inner: Retry::new(
                TowerPolicy {
                    retry: self.retry.clone(),
                },
                inner,
            ),
        }
    }
}

/// One request's exchange, carried in its extensions from attempt to
/// attempt (tower's retry policy is shared by every request).
#[derive(Clone, Debug)]
struct Exchange {
    started: Instant,
    sent: u32,
    key: Option<HeaderValue>,
}

/// Puts the key on a request before its first attempt, and starts its
/// exchange: [`IdempotentRetryLayer`]'s outer service.
#[derive(Clone, Debug)]
pub struct MintKey<S> {
    retry: IdempotentRetry,
    inner: S,
}

impl<S, B> Service<http::Request<B>> for MintKey<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let key = crate::key_for(request.method(), request.headers());
        if let Some(key) = &key {
            request.headers_mut().insert(KEY_HEADER, key.clone());
        }
        self.retry.deposit();
        request.extensions_mut().insert(Exchange {
            started: Instant::now(),
            sent: 0,
            key,
        });
        self.inner.call(request)
    }
}

/// [`IdempotentRetry`]'s decisions as a [`tower::retry::Policy`]: the
/// service inside [`MintKey`].
#[derive(Clone, Debug)]
pub struct TowerPolicy {
    retry: IdempotentRetry,
}

impl<B, R, E> Policy<http::Request<B>, http::Response<R>, E> for TowerPolicy
where
    B: Clone,
{
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        request: &mut http::Request<B>,
        result: &mut Result<http::Response<R>, E>,
    ) -> Option<Self::Future> {
        let exchange = request.extensions_mut().get_mut::<Exchange>()?;
        exchange.sent += 1;
        let ended = match result {
            Ok(answer) => Attempt::Answered {
                status: answer.status().as_u16(),
                retry_after: retry_after(answer.headers()),
            },
            Err(_) => Attempt::NoAnswer,
        };
        match self.retry.next(exchange.started, exchange.sent, ended) {
            Some(wait) => Some(tokio::time::sleep(wait)),
            None => {
                if let Ok(answer) = result {
                    answer.extensions_mut().insert(Attempts {
                        sent: exchange.sent,
                        key: exchange.key.clone(),
                    });
                }
                None
            }
        }
    }

    fn clone_request(&mut self, request: &http::Request<B>) -> Option<http::Request<B>> {
        let mut clone = http::Request::new(request.body().clone());
        *clone.method_mut() = request.method().clone();
        *clone.uri_mut() = request.uri().clone();
        *clone.version_mut() = request.version();
        *clone.headers_mut() = request.headers().clone();
        if let Some(exchange) = request.extensions().get::<Exchange>() {
            clone.extensions_mut().insert(exchange.clone());
        }
        Some(clone)
    }
}
