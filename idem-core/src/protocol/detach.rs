//! [`Detached`]: a future that runs to its end even when whoever polls it
//! goes away.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A future polled in place (no task, no copy) while it is awaited, and handed
/// to `spawn` to finish in the background if it is dropped before its end. The
/// protocol wraps the handler's run in it, so a client that disconnects never
/// cancels the handler or leaves its record half done, at no cost when it
/// stays.
#[must_use = "futures do nothing unless awaited"]
pub(super) struct Detached<F: Future> {
    future: Option<Pin<Box<F>>>,
    spawn: fn(Pin<Box<F>>),
}

impl<F: Future> Detached<F> {
    /// `future`, finished by `spawn` (say `|rest| { tokio::spawn(rest); }`) if
    /// it is dropped before its end.
    pub(super) fn new(future: F, spawn: fn(Pin<Box<F>>)) -> Self {
        Self {
            future: Some(Box::pin(future)),
            spawn,
        }
    }
}

impl<F: Future> Future for Detached<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<F: Future> Drop for Detached<F> {
    fn drop(&mut self) {
        if let Some(rest) = self.future.take() {
            (self.spawn)(rest);
        }
    }
}

// `Detached` never pins its future in place: it is boxed.
impl<F: Future> Unpin for Detached<F> {}

#[cfg(test)]
#[allow(clippy::expect_used)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[tokio::test]
    async fn an_awaited_future_runs_in_place() {
        let answer = Detached::new(async { 42 }, |_| panic!("nothing to spawn")).await;
        assert_eq!(answer, 42);
    }

    #[tokio::test]
    async fn a_dropped_future_finishes_in_a_task() {
        let done = Arc::new(AtomicBool::new(false));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let flag = Arc::clone(&done);
        let detached = Detached::new(
            async move {
                let _ = wait.await;
                flag.store(true, Ordering::SeqCst);
            },
            |rest| {
                tokio::spawn(rest);
            },
        );
        // Polled once (it waits), then dropped: the rest goes on in a task.
        let mut detached = detached;
        assert!(
            std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut detached).poll(cx)))
                .await
                .is_pending()
        );
        drop(detached);
        go.send(()).expect("the task holds the receiver");
        for _ in 0..100 {
            if done.load(Ordering::SeqCst) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the dropped future did not finish in its task");
    }
}
