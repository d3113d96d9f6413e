//! An inbox over any `Store`, through the engine.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{
    Attempt, Buried, Counted, DeadLetter, Entered, Entry, Failure, Handler, Inbox, InboxError,
    InboxFuture, Message,
};
use crate::store::{ClaimOutcome, ClaimRequest, OwnerToken, RecordState};
use crate::{
    Begin, Engine, Fingerprint, IdempotencyKey, InProgress, Policy, ProblemKind, Scope, Store,
    StoredResponse,
};

/// An inbox over any [`Store`] (the in-memory store, Redis, a database
/// store), for effects outside a database: a provider called with a
/// forwarded key, state kept in Redis.
///
/// A message runs through the [`Engine`], as a keyed request does: it is
/// claimed under its id, its lease is renewed while the handler runs, and its
/// completion is recorded. So **one execution runs at a time per message id,
/// and a finished one never runs again**; a concurrent delivery waits for the
/// first to end (up to the lease) and is then a duplicate. There is no
/// transaction (`Tx = ()`): a handler that fails after part of its effect
/// leaves that part, so its effect should be idempotent in itself (a provider
/// call with the message id as its key).
///
/// Failures, dead letters and re-drives are records of their own, each
/// written once by a claim (so two consumers never count one failure twice):
/// attempt `k` of a message, its dead letter and its "published" mark, its
/// re-drive generation, and the consumer's numbered index of buries and
/// re-drives, whose difference is the dead-letter count (found in a
/// logarithmic number of reads, then remembered). Processed messages are
/// kept for the [`retention`](Self::retention) (7 days by default); dead
/// letters and their index for ten years unless re-driven.
///
/// ```
/// use idem_core::MemoryStore;
/// use idem_core::consume::{ConsumerPolicy, Protocol, StoreInbox};
///
/// let inbox = StoreInbox::new(MemoryStore::new());
/// let protocol = Protocol::new("emails", inbox, ConsumerPolicy::new().max_attempts(3));
/// # let _ = protocol;
/// ```
#[derive(Clone)]
pub struct StoreInbox {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn Store>,
    engine: Engine,
    retention: Duration,
    /// The highest bury and re-drive index seen per consumer: where the
    /// next search starts.
    seen: Mutex<HashMap<(String, Series), u64>>,
}

/// How long dead letters, their marks and the index are kept.
const LETTER_RETENTION: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);

/// How long a claim that writes one bookkeeping record may take.
const WRITE_LEASE: Duration = Duration::from_secs(30);

/// A numbered series of records per consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Series {
    Buried,
    Redriven,
}

impl Series {
    fn prefix(self) -> &'static str {
        match self {
            Self::Buried => "b",
            Self::Redriven => "r",
        }
    }
}

#[derive(Serialize, Deserialize)]
struct FailureRecord {
    at: u64,
}

#[derive(Serialize, Deserialize)]
struct LetterRecord {
    message_id: String,
    attempts: u32,
    reason: String,
    attempted_at: Vec<u64>,
    dead_at: u64,
}

#[derive(Serialize, Deserialize)]
struct IndexRecord {
    hash: String,
    generation: u64,
}

impl StoreInbox {
    /// An inbox over `store`, with a lease of 30 s (renewed while a handler
    /// runs) and 7 days' retention of processed messages.
    pub fn new(store: impl Store) -> Self {
        Self::from_shared(Arc::new(store))
    }

    /// An inbox over a store already shared.
    pub fn from_shared(store: Arc<dyn Store>) -> Self {
        Self::build(
            store,
            Duration::from_secs(30),
            Duration::from_secs(7 * 24 * 60 * 60),
        )
    }

    fn build(store: Arc<dyn Store>, lease: Duration, retention: Duration) -> Self {
        let policy = Policy::required()
            .lease(lease)
            .retention(retention)
            .in_progress(InProgress::Wait { up_to: lease });
        Self {
            inner: Arc::new(Inner {
                engine: Engine::from_shared(Arc::clone(&store), policy),
                store,
                retention,
                seen: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Sets the lease of a running handler (renewed every quarter of it, so a
    /// handler may run longer), which is also how long a concurrent delivery
    /// waits before it is handed back to the broker.
    #[must_use]
    pub fn lease(self, lease: Duration) -> Self {
        Self::build(Arc::clone(&self.inner.store), lease, self.inner.retention)
    }

    /// Sets how long processed messages are remembered: longer than the
    /// broker redelivers.
    #[must_use]
    pub fn retention(self, retention: Duration) -> Self {
        let lease = self.inner.engine.policy().get_lease();
        Self::build(Arc::clone(&self.inner.store), lease, retention)
    }

    /// The lease of a running handler.
    pub fn get_lease(&self) -> Duration {
        self.inner.engine.policy().get_lease()
    }

    /// How long processed messages are remembered.
    pub fn get_retention(&self) -> Duration {
        self.inner.retention
    }

    fn scope(consumer: &str) -> Scope {
        Scope::new(format!("idem-inbox:{consumer}"))
    }

    /// A record's key: ASCII, short, whatever the message id.
    fn key(text: String) -> Result<IdempotencyKey, InboxError> {
        IdempotencyKey::new(&text).map_err(|error| InboxError::Corrupt(error.to_string()))
    }

    /// The message id's digest, which names its records.
    fn hash(message_id: &str) -> String {
        let digest = Sha256::digest(message_id.as_bytes());
        digest[..16].iter().map(|b| format!("{b:02x}")).collect()
    }

    async fn exists(&self, consumer: &str, key: String) -> Result<Option<Bytes>, InboxError> {
        let key = Self::key(key)?;
        let record = self
            .inner
            .store
            .load(&Self::scope(consumer), &key)
            .await
            .map_err(InboxError::unavailable)?;
        Ok(record.map(|record| match record.state {
            RecordState::Completed { response } => response.body,
            RecordState::InProgress { .. } => Bytes::new(),
        }))
    }

    /// Writes `body` under `key` unless a record is there: answers whether
    /// this call wrote it.
    async fn put_once(
        &self,
        consumer: &str,
        key: String,
        body: Vec<u8>,
        retention: Duration,
    ) -> Result<bool, InboxError> {
        let request = ClaimRequest {
            scope: Self::scope(consumer),
            key: Self::key(key)?,
            fingerprint: Fingerprint::from_bytes([0; 32]),
            owner: OwnerToken::random(),
            lease: WRITE_LEASE,
            retention,
        };
        let store = &self.inner.store;
        match store
            .claim(&request)
            .await
            .map_err(InboxError::unavailable)?
        {
            ClaimOutcome::Claimed(claim) => {
                let response = StoredResponse::new(200, Vec::new(), body);
                store
                    .complete(&claim, &response, retention)
                    .await
                    .map_err(InboxError::unavailable)?;
                Ok(true)
            }
            ClaimOutcome::Completed { .. } | ClaimOutcome::InProgress { .. } => Ok(false),
        }
    }

    /// The message's re-drive generation: how many times it was re-driven.
    async fn generation(&self, consumer: &str, hash: &str) -> Result<u64, InboxError> {
        let mut generation = 0;
        while self
            .exists(consumer, format!("g:{hash}:{}", generation + 1))
            .await?
            .is_some()
        {
            generation += 1;
        }
        Ok(generation)
    }

    /// The message's failures in this generation, with their times.
    async fn failures(
        &self,
        consumer: &str,
        hash: &str,
        generation: u64,
    ) -> Result<Vec<SystemTime>, InboxError> {
        let mut times = Vec::new();
        while let Some(body) = self
            .exists(
                consumer,
                format!("f:{hash}:{generation}:{}", times.len() + 1),
            )
            .await?
        {
            times.push(decode::<FailureRecord>(&body).map_or(UNIX_EPOCH, |f| micros_time(f.at)));
        }
        Ok(times)
    }

    async fn letter(
        &self,
        consumer: &str,
        hash: &str,
        generation: u64,
    ) -> Result<Option<DeadLetter>, InboxError> {
        let Some(body) = self
            .exists(consumer, format!("d:{hash}:{generation}"))
            .await?
        else {
            return Ok(None);
        };
        let record: LetterRecord = decode(&body)?;
        let published = self
            .exists(consumer, format!("p:{hash}:{generation}"))
            .await?
            .is_some();
        Ok(Some(DeadLetter {
            consumer: consumer.to_owned(),
            message_id: record.message_id,
            attempts: record.attempts,
            reason: record.reason,
            attempted_at: record.attempted_at.into_iter().map(micros_time).collect(),
            dead_at: micros_time(record.dead_at),
            published,
        }))
    }

    /// The highest index of `series` written for `consumer`: index records
    /// are written in order and never deleted (within their retention), so
    /// the present ones are `1..=n`: found by doubling, then bisecting, from
    /// the highest seen.
    async fn last_index(&self, consumer: &str, series: Series) -> Result<u64, InboxError> {
        let present = |n: u64| async move {
            if n == 0 {
                return Ok(true);
            }
            self.exists(consumer, format!("{}:{n}", series.prefix()))
                .await
                .map(|found| found.is_some())
        };
        let mut low = self.seen(consumer, series);
        if !present(low).await? {
            low = 0;
        }
        let mut step = 1;
        let mut high = low + step;
        while present(high).await? {
            low = high;
            step *= 2;
            high = low + step;
        }
        // present(low), !present(high)
        while high - low > 1 {
            let middle = low + (high - low) / 2;
            if present(middle).await? {
                low = middle;
            } else {
                high = middle;
            }
        }
        self.remember(consumer, series, low);
        Ok(low)
    }

    /// Writes the next index record of `series`, answering its number.
    async fn append(
        &self,
        consumer: &str,
        series: Series,
        record: &IndexRecord,
    ) -> Result<u64, InboxError> {
        let body = encode(record)?;
        let mut n = self.last_index(consumer, series).await? + 1;
        while !self
            .put_once(
                consumer,
                format!("{}:{n}", series.prefix()),
                body.clone(),
                LETTER_RETENTION,
            )
            .await?
        {
            n += 1;
        }
        self.remember(consumer, series, n);
        Ok(n)
    }

    fn seen(&self, consumer: &str, series: Series) -> u64 {
        let seen = self.inner.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&(consumer.to_owned(), series))
            .copied()
            .unwrap_or(0)
    }

    fn remember(&self, consumer: &str, series: Series, n: u64) {
        let mut seen = self.inner.seen.lock().unwrap_or_else(|p| p.into_inner());
        let entry = seen.entry((consumer.to_owned(), series)).or_insert(0);
        *entry = (*entry).max(n);
    }
}

impl Inbox for StoreInbox {
    type Tx = ();
    const TRANSACTIONAL: bool = false;

    /// The store's: an engine was built on it, so it was ready then.
    fn readiness(&self) -> Result<(), crate::store::NotReady> {
        self.inner.store.readiness()
    }

    fn process<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<()> + 'a),
    ) -> InboxFuture<'a, Entered> {
        Box::pin(async move {
            let consumer = entry.consumer;
            let hash = Self::hash(entry.message_id);
            let generation = self.generation(consumer, &hash).await?;
            if self
                .exists(consumer, format!("d:{hash}:{generation}"))
                .await?
                .is_some()
            {
                let published = self
                    .exists(consumer, format!("p:{hash}:{generation}"))
                    .await?
                    .is_some();
                return Ok(Entered::Dead { published });
            }
            let key = Self::key(format!("m:{hash}"))?;
            let execution = match self
                .inner
                .engine
                .begin(Self::scope(consumer), key, entry.fingerprint)
                .await
            {
                Begin::Execute(execution) => execution,
                Begin::Replay(_) => return Ok(Entered::Duplicate),
                Begin::Reject(problem) if problem.kind == ProblemKind::KeyReused => {
                    return Ok(Entered::Reused);
                }
                Begin::Reject(problem) => {
                    return Err(InboxError::unavailable(problem.detail));
                }
                Begin::Unguarded => {
                    return Err(InboxError::unavailable("the store is unavailable"));
                }
            };
            let failures = self.failures(consumer, &hash, generation).await?;
            let attempt = failures.len() as u32 + 1;
            let ran = execution
                .run(handler.handle(Attempt::new(message, entry.message_id, attempt), &mut ()))
                .await;
            match ran {
                Ok(()) => {
                    let done = StoredResponse::new(200, Vec::new(), Vec::new());
                    let _ = execution.settle(&done).await;
                    Ok(Entered::Processed { attempt })
                }
                Err(error) => {
                    execution.release().await;
                    Ok(Entered::Failed { attempt, error })
                }
            }
        })
    }

    fn fail<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        failure: &'a Failure<'a>,
    ) -> InboxFuture<'a, Counted> {
        Box::pin(async move {
            let consumer = entry.consumer;
            let hash = Self::hash(entry.message_id);
            let generation = self.generation(consumer, &hash).await?;
            if let Some(letter) = self.letter(consumer, &hash, generation).await? {
                return Ok(Counted {
                    attempts: letter.attempts,
                    attempted_at: letter.attempted_at,
                    buried: Some(Buried::Already {
                        published: letter.published,
                    }),
                });
            }
            let record = encode(&FailureRecord {
                at: time_micros(entry.at),
            })?;
            let mut attempts = self.failures(consumer, &hash, generation).await?.len() as u64 + 1;
            while !self
                .put_once(
                    consumer,
                    format!("f:{hash}:{generation}:{attempts}"),
                    record.clone(),
                    LETTER_RETENTION,
                )
                .await?
            {
                attempts += 1;
            }
            let attempted_at = self.failures(consumer, &hash, generation).await?;
            let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
            if attempts < failure.bury_at {
                return Ok(Counted {
                    attempts,
                    attempted_at,
                    buried: None,
                });
            }
            let letter = encode(&LetterRecord {
                message_id: entry.message_id.to_owned(),
                attempts,
                reason: failure.reason.to_owned(),
                attempted_at: attempted_at.iter().map(|t| time_micros(*t)).collect(),
                dead_at: time_micros(SystemTime::now()),
            })?;
            let buried = self
                .put_once(
                    consumer,
                    format!("d:{hash}:{generation}"),
                    letter,
                    LETTER_RETENTION,
                )
                .await?;
            if !buried {
                let published = self
                    .exists(consumer, format!("p:{hash}:{generation}"))
                    .await?
                    .is_some();
                return Ok(Counted {
                    attempts,
                    attempted_at,
                    buried: Some(Buried::Already { published }),
                });
            }
            let index = IndexRecord { hash, generation };
            let buried_n = self.append(consumer, Series::Buried, &index).await?;
            let redriven = self.last_index(consumer, Series::Redriven).await?;
            Ok(Counted {
                attempts,
                attempted_at,
                buried: Some(Buried::New {
                    dead_letters: buried_n.saturating_sub(redriven),
                }),
            })
        })
    }

    fn published<'a>(&'a self, consumer: &'a str, message_id: &'a str) -> InboxFuture<'a, ()> {
        Box::pin(async move {
            let hash = Self::hash(message_id);
            let generation = self.generation(consumer, &hash).await?;
            self.put_once(
                consumer,
                format!("p:{hash}:{generation}"),
                Vec::new(),
                LETTER_RETENTION,
            )
            .await?;
            Ok(())
        })
    }

    fn dead_letter<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> InboxFuture<'a, Option<DeadLetter>> {
        Box::pin(async move {
            let hash = Self::hash(message_id);
            let generation = self.generation(consumer, &hash).await?;
            self.letter(consumer, &hash, generation).await
        })
    }

    fn dead_letters<'a>(&'a self, consumer: &'a str) -> InboxFuture<'a, Vec<DeadLetter>> {
        Box::pin(async move {
            let last = self.last_index(consumer, Series::Buried).await?;
            let mut letters = Vec::new();
            for n in 1..=last {
                let Some(body) = self
                    .exists(consumer, format!("{}:{n}", Series::Buried.prefix()))
                    .await?
                else {
                    continue;
                };
                let index: IndexRecord = decode(&body)?;
                if self.generation(consumer, &index.hash).await? != index.generation {
                    continue;
                }
                if let Some(letter) = self.letter(consumer, &index.hash, index.generation).await? {
                    letters.push(letter);
                }
            }
            letters.sort_by(|a, b| (a.dead_at, &a.message_id).cmp(&(b.dead_at, &b.message_id)));
            Ok(letters)
        })
    }

    fn redrive<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> InboxFuture<'a, Option<DeadLetter>> {
        Box::pin(async move {
            let hash = Self::hash(message_id);
            let generation = self.generation(consumer, &hash).await?;
            let Some(letter) = self.letter(consumer, &hash, generation).await? else {
                return Ok(None);
            };
            let next = generation + 1;
            if !self
                .put_once(
                    consumer,
                    format!("g:{hash}:{next}"),
                    Vec::new(),
                    LETTER_RETENTION,
                )
                .await?
            {
                // Another redrive of it won.
                return Ok(None);
            }
            let index = IndexRecord {
                hash,
                generation: next,
            };
            self.append(consumer, Series::Redriven, &index).await?;
            Ok(Some(letter))
        })
    }
}

impl std::fmt::Debug for StoreInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreInbox")
            .field("lease", &self.inner.engine.policy().get_lease())
            .field("retention", &self.inner.retention)
            .finish_non_exhaustive()
    }
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, InboxError> {
    serde_json::to_vec(value).map_err(|error| InboxError::Corrupt(error.to_string()))
}

fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, InboxError> {
    serde_json::from_slice(body).map_err(|error| InboxError::Corrupt(error.to_string()))
}

fn time_micros(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

fn micros_time(micros: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(micros)
}
