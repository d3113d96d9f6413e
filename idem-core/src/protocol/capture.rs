//! Reading the handler's answer: whole when it fits the stored-body limit (to
//! record it), or sent on as it streams when it does not.

use std::fmt::Display;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use super::intake::Joined;
use super::{Delivered, Handled, HandlerBody};
use crate::Header;

/// The handler's answer as read for the record and as sent on.
pub(super) struct Captured<T, S> {
    /// What the adapter needs back to send the answer.
    pub(super) head: T,
    pub(super) status: u16,
    pub(super) headers: Vec<Header>,
    /// The body to record, when it is within the limit.
    pub(super) stored: Option<Bytes>,
    pub(super) delivered: Delivered<S>,
}

/// Reads the handler's body until it ends or passes `limit` bytes. A body that
/// fails while it is read gives back the head alone.
pub(super) async fn capture<T, S, E>(
    handled: Handled<T, S>,
    limit: usize,
) -> Result<Captured<T, S>, T>
where
    S: Stream<Item = Result<Bytes, E>>,
    E: Display,
{
    let Handled {
        head,
        status,
        headers,
        body,
    } = handled;
    let (stored, delivered) = match body {
        HandlerBody::Complete(bytes) => (
            (bytes.len() <= limit).then(|| bytes.clone()),
            Delivered::Complete(bytes),
        ),
        HandlerBody::Streaming {
            body,
            length: Some(length),
        } if length > limit as u64 => (None, Delivered::Untouched(body)),
        HandlerBody::Streaming { body, .. } => {
            let mut rest = Box::pin(body);
            let mut chunks = Joined::default();
            let mut over = false;
            while let Some(chunk) = rest.next().await {
                let chunk = match chunk {
                    Ok(chunk) => chunk,
                    Err(error) => {
                        tracing::error!(target: "idem", %error, "the response body failed while it was read");
                        return Err(head);
                    }
                };
                chunks.push(chunk);
                if chunks.len() > limit {
                    over = true;
                    break;
                }
            }
            let read = chunks.join();
            if over {
                (None, Delivered::Resumed { read, rest })
            } else {
                (Some(read.clone()), Delivered::Complete(read))
            }
        }
    };
    Ok(Captured {
        head,
        status,
        headers,
        stored,
        delivered,
    })
}
