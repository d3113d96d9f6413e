//! The loop every broker crate runs its deliveries in: up to N at once, held
//! while the inbox is unavailable, stopped gracefully, drained within a
//! deadline.
//!
//! A broker crate says how it takes deliveries ([`Intake`]: a RabbitMQ
//! subscription, an SQS long poll) and what carries one out (a task that
//! decides it and settles it on the broker); [`Runner::run`] does the rest,
//! the same way on every broker:
//!
//! - **Bounded:** at most [`concurrency`](Runner::concurrency) deliveries in
//!   hand; a take asks for the free room only.
//! - **Held through an outage:** while a delivery is held because the inbox
//!   is unavailable ([`Outage`]), nothing more is taken; once none is, taking
//!   resumes by itself. A take already under way is the intake's to end:
//!   one that can stop without losing anything (a RabbitMQ subscription's
//!   next delivery) answers nothing once an outage begins
//!   ([`Outage::began`]); an SQS receive completes (abandoning it would lose
//!   what SQS already handed over, and spend a receive), its messages held
//!   in turn.
//! - **Stopped gracefully:** once the shutdown resolves, nothing more is
//!   taken (the take under way is dropped), the broker's sending stops
//!   ([`Intake::stopper`]), the held deliveries stop waiting
//!   ([`StopSignal`]), and the running ones finish within
//!   [`shutdown_timeout`](Runner::shutdown_timeout); those still running
//!   then are dropped (a database inbox rolls their transaction back) and
//!   their deliveries come back from the broker.
//! - **Ended by a failure:** a take or a delivery that answers an error
//!   ends the run the same way (without [`Intake::stopper`]: the broker is
//!   gone) and [`Runner::run`] answers it; whether to connect again is the
//!   broker crate's choice.
//!
//! Kafka's records are not taken this way: a partition's records are applied
//! in order, one worker per partition (idem-kafka), so its concurrency is
//! the number of partitions it is assigned.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::task::JoinSet;

use super::{Outage, StopSignal};
use crate::log::error_chain;
use crate::retry::Backoff;

/// How long a graceful shutdown waits for the running handlers, unless told
/// otherwise (every broker crate's `ConsumerBuilder::shutdown_timeout`).
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// The delays between attempts to reach a broker that failed (connect
/// again, poll again), unless told otherwise (every broker crate's
/// `ConsumerBuilder::broker_backoff`): full jitter from 250 ms, capped at
/// 10 s.
pub fn default_broker_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(250), Duration::from_secs(10))
}

/// What carries out one unit a take answered: decides its deliveries and
/// settles them on the broker. An error is the broker's (its connection is
/// gone): it ends the run.
pub type Work<E> = Pin<Box<dyn Future<Output = Result<(), E>> + Send>>;

/// What a take answers: units of work, each with the room it takes (how
/// many deliveries it holds, or a whole batch's room for a batch), or the
/// error that ends the run.
pub type Taken<E> = Result<Vec<(usize, Work<E>)>, E>;

/// How a broker crate takes deliveries, for [`Runner::run`].
pub trait Intake: Send {
    /// The broker crate's error.
    type Error: std::error::Error + Send + 'static;

    /// Waits for what the broker has, up to `room` deliveries (at least 1),
    /// and answers it as units of work, each with the room it takes: how
    /// many deliveries it holds (one per delivery; an SQS FIFO group's
    /// messages together, in their order), or, for a batch, the batch's
    /// whole size, so that the next batch fills while one runs. An empty answer (a long poll that found nothing, a
    /// failure that polling again can help, after its pause) is no error:
    /// the runner looks at its room and the outage again before the next
    /// take, so that nothing is received while a delivery is held. An error
    /// ends the run (the broker crate may connect again).
    fn take(&mut self, room: usize) -> impl Future<Output = Taken<Self::Error>> + Send;

    /// Whether a unit's task that failed (a panic outside the handler,
    /// which the protocol catches: a bug) ends the run, and with which
    /// error: a broker that hands a delivery back only when its session ends
    /// (RabbitMQ) ends it. By default it is logged, and its deliveries come
    /// back by themselves (an SQS lease runs out).
    fn task_failed(why: &tokio::task::JoinError) -> Option<Self::Error> {
        let _ = why;
        None
    }

    /// What stops the broker's sending at a graceful stop, before the
    /// running deliveries finish (RabbitMQ's `basic.cancel`); asked for once,
    /// at the start of a run, and awaited only at a graceful stop. Nothing by
    /// default.
    fn stopper(&self) -> impl Future<Output = ()> + Send + 'static {
        async {}
    }
}

/// How a broker crate's consumer runs its deliveries (see the
/// [module](self)).
#[derive(Debug)]
pub struct Runner<'a> {
    /// The most deliveries in hand at once (at least 1).
    pub concurrency: usize,
    /// How long a graceful stop waits for the running deliveries.
    pub shutdown_timeout: Duration,
    /// The consumer's deliveries held while the inbox is unavailable.
    pub outage: &'a Outage,
    /// Set when the run ends: a held delivery stops waiting.
    pub stop: &'a StopSignal,
    /// What the logs name (their field `queue`, as the broker crates' own lines): the queue.
    pub source: &'a str,
    /// How a delivery not settled comes back, for the logs ("from the
    /// broker", "after its lease").
    pub comes_back: &'static str,
}

/// The units of work running, and how many deliveries each holds.
struct Running<E> {
    tasks: JoinSet<Result<(), E>>,
    sizes: HashMap<tokio::task::Id, usize>,
    in_hand: usize,
}

impl<E: Send + 'static> Running<E> {
    fn new() -> Self {
        Self {
            tasks: JoinSet::new(),
            sizes: HashMap::new(),
            in_hand: 0,
        }
    }

    fn spawn(&mut self, size: usize, work: Work<E>) {
        self.in_hand += size;
        let task = self.tasks.spawn(work);
        self.sizes.insert(task.id(), size);
    }

    /// The next unit that ended, its deliveries no longer in hand; pending
    /// while none runs.
    async fn joined(&mut self) -> Result<Result<(), E>, tokio::task::JoinError> {
        let Some(joined) = self.tasks.join_next_with_id().await else {
            return std::future::pending().await;
        };
        let id = match &joined {
            Ok((id, _)) => *id,
            Err(error) => error.id(),
        };
        self.in_hand = self
            .in_hand
            .saturating_sub(self.sizes.remove(&id).unwrap_or(0));
        joined.map(|(_, outcome)| outcome)
    }
}

impl Runner<'_> {
    /// Takes from `intake` and runs what it takes until `shutdown` resolves
    /// (`Ok`) or a take or a unit of work fails (that error); either way the
    /// running units finish within the shutdown timeout first.
    pub async fn run<'i, T: Intake + 'i>(
        &self,
        intake: T,
        shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<(), T::Error> {
        let mut shutdown = shutdown;
        let concurrency = self.concurrency.max(1);
        let stopper = intake.stopper();
        self.stop.set(false);
        let mut running: Running<T::Error> = Running::new();
        // The intake, or the take under way that holds it: kept across the
        // loop's turns, so a receive is never abandoned but at the end.
        let mut idle = Some(intake);
        let mut taking: Option<Pin<Box<Taking<'i, T>>>> = None;
        let failed = loop {
            let room = concurrency.saturating_sub(running.in_hand);
            let held = self.outage.is_on();
            if room > 0
                && !held
                && let Some(mut intake) = idle.take()
            {
                taking = Some(Box::pin(async move {
                    let taken = intake.take(room).await;
                    (intake, taken)
                }));
            }
            tokio::select! {
                biased;
                () = shutdown.as_mut() => break None,
                joined = running.joined() => match joined {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => break Some(error),
                    Err(error) if error.is_cancelled() => {}
                    Err(error) => match T::task_failed(&error) {
                        Some(error) => break Some(error),
                        None => tracing::error!(target: "idem", queue = self.source, error = %error, "a delivery's task failed; its deliveries come back {}", self.comes_back),
                    },
                },
                // Held deliveries wait for the inbox: take again once none is.
                () = self.outage.over(), if held && taking.is_none() => {}
                (intake, taken) = next_take(&mut taking) => {
                    taking = None;
                    idle = Some(intake);
                    match taken {
                        Ok(units) => {
                            for (size, work) in units {
                                running.spawn(size, work);
                            }
                        }
                        Err(error) => break Some(error),
                    }
                }
            }
        };
        drop(taking);
        drop(idle);
        self.stop.set(true);
        if failed.is_none() {
            tracing::info!(target: "idem", queue = self.source, running = running.in_hand, "stopping: nothing more is taken; the running deliveries finish");
            stopper.await;
        }
        self.drain(&mut running).await;
        match failed {
            None => {
                tracing::info!(target: "idem", queue = self.source, "stopped");
                Ok(())
            }
            Some(error) => Err(error),
        }
    }

    /// Waits for the running units within the shutdown timeout, then drops
    /// the rest.
    async fn drain<E: std::error::Error + Send + 'static>(&self, running: &mut Running<E>) {
        let waited = tokio::time::timeout(self.shutdown_timeout, async {
            while let Some(joined) = running.tasks.join_next().await {
                match joined {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => tracing::warn!(target: "idem", queue = self.source, error = %error_chain(&error), "a delivery could not be settled; it comes back {}", self.comes_back),
                    Err(error) if error.is_cancelled() => {}
                    Err(error) => tracing::error!(target: "idem", queue = self.source, error = %error, "a delivery's task failed; its deliveries come back {}", self.comes_back),
                }
            }
        })
        .await;
        if waited.is_err() {
            tracing::warn!(
                target: "idem",
                queue = self.source,
                abandoned = running.tasks.len(),
                timeout_ms = self.shutdown_timeout.as_millis() as u64,
                "the shutdown deadline passed: the handlers still running are dropped, their deliveries come back {}",
                self.comes_back
            );
            running.tasks.abort_all();
        }
    }
}

/// A take under way, holding its intake.
type Taking<'i, T> = dyn Future<
        Output = (
            T,
            Result<Vec<(usize, Work<<T as Intake>::Error>)>, <T as Intake>::Error>,
        ),
    > + Send
    + 'i;

/// The take under way's answer; pending while there is none.
async fn next_take<'i, T: Intake>(
    taking: &mut Option<Pin<Box<Taking<'i, T>>>>,
) -> (T, Taken<T::Error>) {
    match taking {
        Some(take) => take.as_mut().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::{mpsc, oneshot};

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Failed(&'static str);

    /// Units sent by the test, taken as many as are there up to the room;
    /// records each room it was asked for.
    struct Queue {
        units: mpsc::UnboundedReceiver<Work<Failed>>,
        rooms: Rooms,
    }

    impl Intake for Queue {
        type Error = Failed;

        async fn take(&mut self, room: usize) -> Taken<Failed> {
            self.rooms.lock().unwrap().push(room);
            let Some(first) = self.units.recv().await else {
                return Err(Failed("the queue closed"));
            };
            let mut units = vec![(1, first)];
            while units.len() < room {
                match self.units.try_recv() {
                    Ok(unit) => units.push((1, unit)),
                    Err(_) => break,
                }
            }
            Ok(units)
        }
    }

    type Rooms = Arc<std::sync::Mutex<Vec<usize>>>;

    fn queue() -> (mpsc::UnboundedSender<Work<Failed>>, Queue, Rooms) {
        let (send, units) = mpsc::unbounded_channel();
        let rooms = Arc::default();
        let queue = Queue {
            units,
            rooms: Arc::clone(&rooms),
        };
        (send, queue, rooms)
    }

    fn runner<'a>(concurrency: usize, outage: &'a Outage, stop: &'a StopSignal) -> Runner<'a> {
        Runner {
            concurrency,
            shutdown_timeout: Duration::from_secs(1),
            outage,
            stop,
            source: "q",
            comes_back: "from the broker",
        }
    }

    /// Counts the units running and the most at once.
    #[derive(Default)]
    struct Gauge {
        now: AtomicUsize,
        most: AtomicUsize,
        done: AtomicUsize,
    }

    fn unit(gauge: &Arc<Gauge>, lasts: Duration) -> Work<Failed> {
        let gauge = Arc::clone(gauge);
        Box::pin(async move {
            let now = gauge.now.fetch_add(1, Ordering::SeqCst) + 1;
            gauge.most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(lasts).await;
            gauge.now.fetch_sub(1, Ordering::SeqCst);
            gauge.done.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }

    #[tokio::test(start_paused = true)]
    async fn never_more_in_hand_than_the_concurrency_and_a_take_asks_for_the_room_only() {
        let (outage, stop) = (Outage::new(), StopSignal::new());
        let (send, queue, rooms) = queue();
        let gauge = Arc::new(Gauge::default());
        for _ in 0..20 {
            send.send(unit(&gauge, Duration::from_millis(100))).unwrap();
        }
        let watched = Arc::clone(&gauge);
        let shutdown = async move {
            while watched.done.load(Ordering::SeqCst) < 20 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let outcome = runner(3, &outage, &stop)
            .run(queue, std::pin::pin!(shutdown))
            .await;
        assert!(outcome.is_ok());
        assert_eq!(gauge.done.load(Ordering::SeqCst), 20);
        assert_eq!(gauge.most.load(Ordering::SeqCst), 3);
        let rooms = rooms.lock().unwrap();
        assert_eq!(rooms[0], 3, "the first take asks for every slot");
        assert!(
            rooms.iter().all(|&room| (1..=3).contains(&room)),
            "{rooms:?}"
        );
        assert!(stop.is_set(), "the end of the run sets the stop");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_lets_the_running_finish_and_drops_what_outlives_the_deadline() {
        let (outage, stop) = (Outage::new(), StopSignal::new());
        let (send, queue, _) = queue();
        let gauge = Arc::new(Gauge::default());
        send.send(unit(&gauge, Duration::from_millis(500))).unwrap();
        send.send(unit(&gauge, Duration::from_secs(3600))).unwrap();
        let (started, shutdown) = oneshot::channel::<()>();
        let run = runner(2, &outage, &stop);
        let stopping = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(started);
        };
        let begun = tokio::time::Instant::now();
        let shutdown = std::pin::pin!(async {
            let _ = shutdown.await;
        });
        let (outcome, ()) = tokio::join!(run.run(queue, shutdown), stopping);
        assert!(outcome.is_ok());
        assert_eq!(
            gauge.done.load(Ordering::SeqCst),
            1,
            "the short one finished"
        );
        assert_eq!(
            gauge.now.load(Ordering::SeqCst),
            1,
            "the long one was dropped"
        );
        // The stop at 100 ms, then the shutdown timeout of 1 s.
        assert_eq!(begun.elapsed(), Duration::from_millis(1100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_unit_that_fails_ends_the_run_with_its_error_after_the_others_finish() {
        let (outage, stop) = (Outage::new(), StopSignal::new());
        let (send, queue, _) = queue();
        let gauge = Arc::new(Gauge::default());
        send.send(unit(&gauge, Duration::from_millis(300))).unwrap();
        send.send(Box::pin(async { Err(Failed("the channel is gone")) }))
            .unwrap();
        let outcome = runner(2, &outage, &stop)
            .run(queue, std::pin::pin!(std::future::pending::<()>()))
            .await;
        assert_eq!(outcome.unwrap_err().to_string(), "the channel is gone");
        assert_eq!(
            gauge.done.load(Ordering::SeqCst),
            1,
            "the other finished first"
        );
        assert!(stop.is_set());
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_taken_while_a_delivery_is_held() {
        let (outage, stop) = (Outage::new(), StopSignal::new());
        let (send, queue, rooms) = queue();
        let gauge = Arc::new(Gauge::default());
        let (release, released) = oneshot::channel::<()>();
        let held_by = outage.clone();
        // The first unit holds until released, as a delivery held through
        // an outage does.
        send.send(Box::pin(async move {
            let _held = held_by.hold();
            let _ = released.await;
            Ok(())
        }))
        .unwrap();
        let (end, ended) = oneshot::channel::<()>();
        let run = runner(4, &outage, &stop);
        let shutdown = std::pin::pin!(async {
            let _ = ended.await;
        });
        let (outcome, ()) = tokio::join!(run.run(queue, shutdown), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(outage.is_on());
            // The take under way when the hold began completes (its
            // units start); no other take follows while one is held.
            send.send(unit(&gauge, Duration::from_millis(1))).unwrap();
            send.send(unit(&gauge, Duration::from_millis(1))).unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert_eq!(gauge.done.load(Ordering::SeqCst), 2);
            assert_eq!(rooms.lock().unwrap().len(), 2, "no take while held");
            release.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!outage.is_on());
            assert_eq!(rooms.lock().unwrap().len(), 3, "taking resumes by itself");
            end.send(()).unwrap();
        });
        assert!(outcome.is_ok());
    }
}
