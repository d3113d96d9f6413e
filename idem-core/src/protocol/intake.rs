//! Reading a keyed request's body: against the policy's limit, within its
//! timeout, fingerprinted as it streams.

use std::fmt::Display;
use std::pin::{Pin, pin};
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use tracing::Span;

use crate::engine::Engine;
use crate::{FingerprintHasher, StoredResponse};

/// The most of a refused request body that is read (and dropped) before the `413`.
const DRAIN_BYTES: u64 = 8 * 1024 * 1024;
/// The longest a refused request body is read before the `413`.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Reads the request body, its chunks as they stream, against the policy's
/// limit while fingerprinting it into `hasher`: the whole body, or the answer
/// that refuses it.
///
/// `declared` is the body's declared length (`Content-Length`), if any: a
/// declared length over the limit is refused before a byte is read. A refused
/// body is read and dropped within bounds (8 MiB, 2 s) before the
/// `413 payload-too-large`, so a client still sending reads the answer rather
/// than a reset connection. A body that fails to arrive whole (the client went
/// away, a malformed chunked body) is answered `400 body-unreadable`; one that
/// stalls past the policy's request-body timeout (counted from the first time
/// the body is not ready) is answered `408 body-timeout`, so a client that
/// stops sending cannot hold the connection.
///
/// Nothing is logged while the body streams in, so the span is entered only
/// around the lines a refused body logs, not at every poll.
pub(super) async fn read<B, E>(
    engine: &Engine,
    hasher: &mut FingerprintHasher,
    span: &Span,
    declared: Option<u64>,
    body: &mut B,
) -> Result<Bytes, StoredResponse>
where
    B: Stream<Item = Result<Bytes, E>> + Unpin,
    E: Display,
{
    let limit = engine.policy().get_request_body_limit();
    if declared.is_some_and(|length| length > limit as u64) {
        drain(body, declared).await;
        let _in_span = span.enter();
        return Err(engine.payload_too_large().to_response());
    }
    let mut chunks = Joined::default();
    // Started the first time the body is not ready: a body that has arrived
    // costs no clock reading and no timer.
    let mut deadline = pin!(None::<tokio::time::Sleep>);
    let timeout = engine.policy().get_request_body_timeout();
    loop {
        let next = std::future::poll_fn(|cx| {
            if let Poll::Ready(next) = Pin::new(&mut *body).poll_next(cx) {
                return Poll::Ready(Some(next));
            }
            if deadline.is_none() {
                deadline.set(Some(tokio::time::sleep(timeout)));
            }
            match deadline.as_mut().as_pin_mut().map(|sleep| sleep.poll(cx)) {
                Some(Poll::Ready(())) => Poll::Ready(None),
                _ => Poll::Pending,
            }
        })
        .await;
        let Some(next) = next else {
            let _in_span = span.enter();
            return Err(engine.body_timeout().to_response());
        };
        let Some(chunk) = next else { break };
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(error) => {
                let _in_span = span.enter();
                tracing::debug!(target: "idem", %error, "the request body could not be read");
                return Err(engine.body_unreadable().to_response());
            }
        };
        if chunks.len() + chunk.len() > limit {
            drain(body, None).await;
            let _in_span = span.enter();
            return Err(engine.payload_too_large().to_response());
        }
        hasher.update(&chunk);
        chunks.push(chunk);
    }
    Ok(chunks.join())
}

/// Reads and drops what is left of a refused body, within bounds, so that a
/// client still sending it reads the `413` rather than a reset connection (a
/// server that closes with unread bytes in its socket resets it). A body that is
/// declared or turns out larger than the bound, or slower than the time bound, is
/// left unread: the connection then closes after the answer.
async fn drain<B, E>(body: &mut B, declared: Option<u64>)
where
    B: Stream<Item = Result<Bytes, E>> + Unpin,
{
    if declared.is_some_and(|length| length > DRAIN_BYTES) {
        return;
    }
    let read = async {
        let mut drained = 0u64;
        while let Some(Ok(chunk)) = body.next().await {
            drained += chunk.len() as u64;
            if drained > DRAIN_BYTES {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, read).await;
}

/// A body read chunk by chunk, joined into one `Bytes` at the end: a body that
/// arrives as one chunk (most do) is neither copied nor listed.
#[derive(Default)]
pub(super) struct Joined {
    first: Option<Bytes>,
    more: Vec<Bytes>,
    len: usize,
}

impl Joined {
    pub(super) fn push(&mut self, chunk: Bytes) {
        self.len += chunk.len();
        if self.first.is_none() {
            self.first = Some(chunk);
        } else {
            self.more.push(chunk);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn join(self) -> Bytes {
        let Some(first) = self.first else {
            return Bytes::new();
        };
        if self.more.is_empty() {
            return first;
        }
        let mut joined = BytesMut::with_capacity(self.len);
        joined.extend_from_slice(&first);
        for chunk in self.more {
            joined.extend_from_slice(&chunk);
        }
        joined.freeze()
    }
}
