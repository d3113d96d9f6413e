//! `RedisStore`: the `Store` trait over Redis, one script per step.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use idem_core::store::{
    Claim, ClaimOutcome, ClaimRequest, OwnerToken, Record, RecordState, StoreFuture,
};
use idem_core::{Fingerprint, IdempotencyKey, Scope, Store, StoreError, StoredResponse};
use redis::{Script, Value};
use uuid::Uuid;

use crate::SetupError;
use crate::connection::{RedisConnection, Timeouts};
use crate::key::{record_key, records_pattern};

/// The key prefix unless [`RedisStoreBuilder::prefix`] sets another.
pub const DEFAULT_PREFIX: &str = "idem:";

/// The store's scripts, hashed once. Each call is an `EVALSHA`; after a
/// `NOSCRIPT` (a restarted or failed-over server, `SCRIPT FLUSH`) the script is
/// loaded again and the call repeated.
struct Scripts {
    claim: Script,
    renew: Script,
    complete: Script,
    release: Script,
    load: Script,
    purge: Script,
}

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(
            include_str!("lua/prelude.lua"),
            include_str!(concat!("lua/", $file))
        ))
    };
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: script!("claim.lua"),
    renew: script!("renew.lua"),
    complete: script!("complete.lua"),
    release: script!("release.lua"),
    load: script!("load.lua"),
    purge: script!("purge.lua"),
});

/// Records in Redis or Redis Cluster (or Valkey): each step one atomic Lua
/// script on the record's own key, times from the server's clock, retention
/// through Redis expiry.
///
/// Cloning is cheap: clones share one multiplexed connection. See the
/// [crate docs](crate) for the data model and what it promises.
#[derive(Clone)]
pub struct RedisStore {
    connection: RedisConnection,
    settings: Arc<Settings>,
}

/// Configures a [`RedisStore`]; from [`RedisStore::builder`].
#[derive(Clone, Debug)]
#[must_use]
pub struct RedisStoreBuilder {
    prefix: String,
    grace: Duration,
    timeouts: Timeouts,
    scan_count: usize,
}

struct Settings {
    prefix: String,
    grace_ms: u64,
    scan_count: usize,
}

impl RedisStore {
    /// Connects with the default settings. See [`RedisStoreBuilder::connect`]
    /// for the URLs it takes.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder().connect(url).await
    }

    /// A builder, to set the key prefix, the timeouts or the expiry grace.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            prefix: DEFAULT_PREFIX.to_owned(),
            grace: Duration::from_secs(5),
            timeouts: Timeouts {
                connect: Duration::from_secs(1),
                response: Duration::from_secs(2),
            },
            scan_count: 500,
        }
    }

    /// The store's connection, for the application's own commands (a clone:
    /// it shares the store's connection).
    pub fn connection(&self) -> RedisConnection {
        self.connection.clone()
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.settings.prefix
    }

    /// The Redis key of the record of `(scope, key)`, for tools and tests
    /// (`PREFIX{LEN:SCOPE:KEY}`; see the crate docs). Never log it: it holds
    /// the whole idempotency key.
    pub fn record_key(&self, scope: &Scope, key: &IdempotencyKey) -> Vec<u8> {
        record_key(&self.settings.prefix, scope, key)
    }

    fn key_of(&self, scope: &Scope, key: &IdempotencyKey) -> Vec<u8> {
        self.record_key(scope, key)
    }

    async fn fenced(&self, invocation: redis::ScriptInvocation<'_>) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        let done: i64 = invocation
            .invoke_async(&mut connection)
            .await
            .map_err(StoreError::unavailable)?;
        match done {
            1 => Ok(()),
            _ => Err(StoreError::StaleOwner),
        }
    }
}

impl RedisStoreBuilder {
    /// Prepends `prefix` to every key the store writes, so that several stores
    /// (or applications) share one Redis. It must not hold `{` or `}`. Default:
    /// [`DEFAULT_PREFIX`] (`idem:`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long Redis keeps a record past its expiry (or past its lease, if
    /// later) before it deletes it by itself. Meanwhile the record counts as
    /// absent, and [`Store::delete_expired`] may delete it sooner. Default: five
    /// seconds.
    pub fn expiry_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// How long opening a connection may take. Default: one second.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.timeouts.connect = timeout;
        self
    }

    /// How long a step waits for Redis's answer before it fails (and the
    /// request is answered `503`). Default: two seconds.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.timeouts.response = timeout;
        self
    }

    /// The `COUNT` hint of each `SCAN` of [`Store::delete_expired`]. Default: 500.
    pub fn scan_count(mut self, count: usize) -> Self {
        self.scan_count = count.max(1);
        self
    }

    /// Connects to `url`:
    ///
    /// - `redis://[user:password@]HOST:PORT[/DB]` (or `rediss://` for TLS, if
    ///   redis-rs is built with a TLS feature): one node, connected on the first
    ///   step, so the application may start before Redis;
    /// - `redis+cluster://[user:password@]HOST:PORT[,HOST:PORT…]` (or
    ///   `rediss+cluster://`): a Redis Cluster, any of its nodes; its slot map is
    ///   read now.
    pub async fn connect(self, url: &str) -> Result<RedisStore, SetupError> {
        if self.prefix.contains(['{', '}']) {
            return Err(SetupError::Prefix);
        }
        let connection = RedisConnection::open(url, self.timeouts).await?;
        Ok(RedisStore {
            connection,
            settings: Arc::new(Settings {
                prefix: self.prefix,
                grace_ms: millis(self.grace),
                scan_count: self.scan_count,
            }),
        })
    }
}

impl Store for RedisStore {
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let reply: Vec<Value> = SCRIPTS
                .claim
                .key(self.key_of(&request.scope, &request.key))
                .arg(request.fingerprint.as_bytes().as_slice())
                .arg(request.owner.as_uuid().as_bytes().as_slice())
                .arg(millis(request.lease))
                .arg(millis(request.retention))
                .arg(self.settings.grace_ms)
                .invoke_async(&mut connection)
                .await
                .map_err(StoreError::unavailable)?;
            match reply.as_slice() {
                [Value::Int(1)] => Ok(ClaimOutcome::Claimed(request.to_claim())),
                [Value::Int(2), fingerprint, lease_until] => Ok(ClaimOutcome::InProgress {
                    fingerprint: fingerprint_of(fingerprint)?,
                    lease_until: instant(lease_until)?,
                }),
                [
                    Value::Int(3),
                    fingerprint,
                    status,
                    headers,
                    body,
                    replayable,
                ] => Ok(ClaimOutcome::Completed {
                    fingerprint: fingerprint_of(fingerprint)?,
                    response: response_of(status, headers, body, replayable)?,
                }),
                _ => Err(corrupt("the claim script's answer")),
            }
        })
    }

    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut invocation = SCRIPTS.renew.key(self.key_of(&claim.scope, &claim.key));
            invocation
                .arg(claim.owner.as_uuid().as_bytes().as_slice())
                .arg(millis(lease))
                .arg(self.settings.grace_ms);
            self.fenced(invocation).await
        })
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut invocation = SCRIPTS.complete.key(self.key_of(&claim.scope, &claim.key));
            invocation
                .arg(claim.owner.as_uuid().as_bytes().as_slice())
                .arg(response.status)
                .arg(response.encode_headers())
                .arg(response.body.as_ref())
                .arg(u8::from(response.replayable))
                .arg(millis(retention))
                .arg(self.settings.grace_ms);
            self.fenced(invocation).await
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut invocation = SCRIPTS.release.key(self.key_of(&claim.scope, &claim.key));
            invocation.arg(claim.owner.as_uuid().as_bytes().as_slice());
            self.fenced(invocation).await
        })
    }

    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let reply: Vec<Value> = SCRIPTS
                .load
                .key(self.key_of(scope, key))
                .invoke_async(&mut connection)
                .await
                .map_err(StoreError::unavailable)?;
            let (fingerprint, expires_at, state) = match reply.as_slice() {
                [Value::Int(0)] => return Ok(None),
                [Value::Int(2), fingerprint, expires_at, lease_until, owner] => (
                    fingerprint,
                    expires_at,
                    RecordState::InProgress {
                        owner: owner_of(owner)?,
                        lease_until: instant(lease_until)?,
                    },
                ),
                [
                    Value::Int(3),
                    fingerprint,
                    expires_at,
                    status,
                    headers,
                    body,
                    replayable,
                ] => (
                    fingerprint,
                    expires_at,
                    RecordState::Completed {
                        response: response_of(status, headers, body, replayable)?,
                    },
                ),
                _ => return Err(corrupt("the load script's answer")),
            };
            Ok(Some(Record {
                scope: scope.clone(),
                key: key.clone(),
                fingerprint: fingerprint_of(fingerprint)?,
                state,
                expires_at: instant(expires_at)?,
            }))
        })
    }

    /// Redis deletes expired records by itself, [`expiry_grace`] after they
    /// expire, so no cleanup job is needed. This deletes the ones Redis still
    /// holds: it scans the keys under the prefix on every primary (`SCAN`, which
    /// walks the whole keyspace of each) and deletes each expired record with
    /// one script. Answers 0 when Redis got there first.
    ///
    /// [`expiry_grace`]: RedisStoreBuilder::expiry_grace
    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let pattern = records_pattern(&self.settings.prefix);
            let mut deleted = 0;
            for node in connection
                .primaries()
                .await
                .map_err(StoreError::unavailable)?
            {
                let mut cursor = 0_u64;
                loop {
                    if deleted >= batch {
                        return Ok(deleted as u64);
                    }
                    let mut scan = redis::cmd("SCAN");
                    scan.arg(cursor)
                        .arg("MATCH")
                        .arg(pattern.as_slice())
                        .arg("COUNT")
                        .arg(self.settings.scan_count);
                    let page = connection
                        .on_node(&node, scan)
                        .await
                        .map_err(StoreError::unavailable)?;
                    let (next, keys): (u64, Vec<Vec<u8>>) =
                        redis::from_redis_value(page).map_err(StoreError::unavailable)?;
                    for key in keys {
                        if deleted >= batch {
                            break;
                        }
                        let purged: i64 = SCRIPTS
                            .purge
                            .key(key)
                            .invoke_async(&mut connection)
                            .await
                            .map_err(StoreError::unavailable)?;
                        deleted += usize::from(purged == 1);
                    }
                    if next == 0 {
                        break;
                    }
                    cursor = next;
                }
            }
            Ok(deleted as u64)
        })
    }

    // `changed` is the trait's: it sleeps `poll`, after which the engine
    // claims again (one script call). Redis could notify instead (keyspace
    // notifications, or a `PUBLISH` from the completing script), but
    // notifications need server configuration, and in a cluster a
    // subscription per node; the engine's poll interval starts at 5 ms and
    // backs off to 200 ms, which bounds the added latency of a waiting
    // request.
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.connection {
            RedisConnection::Single(_) => "single node",
            RedisConnection::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore")
            .field("prefix", &self.settings.prefix)
            .field("redis", &kind)
            .finish_non_exhaustive()
    }
}

/// Whole milliseconds, saturating.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("{what} is not a record"))
}

fn bytes_of(value: &Value) -> Result<&[u8], StoreError> {
    match value {
        Value::BulkString(bytes) => Ok(bytes),
        _ => Err(corrupt("a field")),
    }
}

fn int_of(value: &Value) -> Result<i64, StoreError> {
    match value {
        Value::Int(n) => Ok(*n),
        _ => Err(corrupt("a number")),
    }
}

fn fingerprint_of(value: &Value) -> Result<Fingerprint, StoreError> {
    Fingerprint::from_slice(bytes_of(value)?).ok_or_else(|| corrupt("the fingerprint"))
}

fn owner_of(value: &Value) -> Result<OwnerToken, StoreError> {
    Uuid::from_slice(bytes_of(value)?)
        .map(OwnerToken::from_uuid)
        .map_err(|_| corrupt("the owner token"))
}

/// Milliseconds since the Unix epoch, as the scripts answer them.
fn instant(value: &Value) -> Result<SystemTime, StoreError> {
    let ms = u64::try_from(int_of(value)?).map_err(|_| corrupt("an instant"))?;
    Ok(UNIX_EPOCH + Duration::from_millis(ms))
}

fn response_of(
    status: &Value,
    headers: &Value,
    body: &Value,
    replayable: &Value,
) -> Result<StoredResponse, StoreError> {
    let status = u16::try_from(int_of(status)?).map_err(|_| corrupt("the status"))?;
    let headers =
        StoredResponse::decode_headers(bytes_of(headers)?).ok_or_else(|| corrupt("the headers"))?;
    Ok(StoredResponse {
        status,
        headers,
        body: Bytes::copy_from_slice(bytes_of(body)?),
        replayable: int_of(replayable)? == 1,
    })
}
