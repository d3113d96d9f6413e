//! `serve`: the same trivial handler, bare and behind idem's middleware.
//!
//! Besides `/bare` and `/layered`, the axum server has `/layered-slow` (the
//! handler after [`SLOW`](handler::SLOW), behind the same layer) and `GET
//! /executions`, the number of times a handler ran: the bench's duplicates
//! check sends parallel duplicates to the slow route and reads the count.

use std::io::Write;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use idem_core::StoreContext;
use idem_core::store::{ClaimOutcome, ClaimRequest, OwnerToken, ReplayCache};
use idem_core::{Fingerprint, IdempotencyKey, MemoryStore, Policy, Scope, Store};
use idem_diesel::{
    PgOutbox, PgStore, SqlitePool, SqliteStore, SqliteTransaction, SqliteTransactionError,
    Transaction,
};

use crate::BoxError;
use crate::handler::{self, CONTENT_TYPE, SCOPE};

/// What `serve` serves.
#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// `axum` or `actix`.
    #[arg(long)]
    framework: Framework,
    /// `memory`, a `postgres://` or `sqlite://` URL, or a `redis://` or
    /// `redis+cluster://` URL.
    #[arg(long, default_value = "memory")]
    store: String,
    /// Worker threads (tokio workers for axum, actix workers).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// The largest pool of database connections.
    #[arg(long, default_value_t = 10)]
    pool: u32,
    /// With PostgreSQL or SQLite: the layered route in transactional mode (the
    /// handler's writes and the completion in one transaction).
    #[arg(long)]
    transactional: bool,
    /// With `--transactional`: the layered route's handler stages one outbox
    /// event (`PgOutbox::stage`, `{"account_id", "amount"}` keyed by the
    /// account) in the request's transaction, as a charge that announces
    /// itself does.
    #[arg(long, requires = "transactional")]
    outbox: bool,
    /// The layered route's handler writes a row of its own (`INSERT INTO
    /// bench_charges`), as a charge does: in the request's transaction with
    /// `--transactional` (with `--outbox` too, on PostgreSQL, the event is
    /// staged pipelined with that write: one round trip for both); on SQLite
    /// without it, on its own, as a handler over the plain store writes.
    #[arg(long)]
    write: bool,
    /// With `--outbox`: stage without `NOTIFY` (`PgOutboxBuilder::notify(false)`;
    /// a relay then finds the events by polling).
    #[arg(long, requires = "outbox")]
    quiet: bool,
    /// Completed records put in the in-memory store before serving.
    #[arg(long, default_value_t = 0)]
    prefill: usize,
    /// Puts a `ReplayCache` of this many completed records in front of the
    /// store (0: none), so that replays of records this server completed are
    /// answered without a round trip.
    #[arg(long, default_value_t = 0)]
    replay_cache: usize,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Framework {
    Axum,
    Actix,
}

/// The body size of prefilled records.
const PREFILL_BODY: usize = 200;

pub(crate) fn run(options: Options) -> Result<(), BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    match options.framework {
        Framework::Axum => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.workers.max(1))
            .enable_all()
            .build()?
            .block_on(async {
                let store = open(&options).await?;
                let writes = writes(&options).await?;
                axum_server(listener, store, writes).await
            }),
        Framework::Actix => actix_web::rt::System::new().block_on(async {
            if options.outbox || options.write {
                return Err("--outbox and --write are served by axum only".into());
            }
            let store = open(&options).await?;
            actix_server(listener, store, options.workers).await
        }),
    }
}

/// The store the options name, migrated or prefilled, behind a replay cache
/// when asked.
async fn open(options: &Options) -> Result<Arc<dyn Store>, BoxError> {
    let store = open_store(options).await?;
    if options.replay_cache == 0 {
        return Ok(store);
    }
    Ok(Arc::new(ReplayCache::new(store, options.replay_cache)))
}

/// With `--outbox`: the outbox, migrated. Its own pool (one connection) only
/// migrates: events are staged on the request's transaction.
async fn staging_outbox(options: &Options) -> Result<Option<PgOutbox>, BoxError> {
    if !options.outbox {
        return Ok(None);
    }
    if !options.store.starts_with("postgres") {
        return Err("--outbox needs a PostgreSQL store".into());
    }
    let outbox = PgOutbox::builder()
        .notify(!options.quiet)
        .max_connections(1)
        .connect(&options.store)
        .await?;
    outbox.migrate().await?;
    Ok(Some(outbox))
}

/// What the layered route's handler writes, besides answering.
enum Writes {
    /// Nothing.
    Nothing,
    /// On PostgreSQL, in the request's transaction: a row (`--write`), an
    /// outbox event (`--outbox`), or both.
    Postgres { outbox: Option<PgOutbox>, row: bool },
    /// On SQLite, a row in the request's transaction (`SqliteTransaction::write`).
    SqliteInTransaction,
    /// On SQLite, a row on its own, through this pool (the plain store's way).
    SqliteOnItsOwn(SqlitePool),
}

/// What the options ask the handler to write, its table created.
async fn writes(options: &Options) -> Result<Writes, BoxError> {
    if options.store.starts_with("sqlite") {
        if options.outbox {
            return Err("--outbox needs a PostgreSQL store".into());
        }
        if !options.write {
            return Ok(Writes::Nothing);
        }
        let store = SqliteStore::builder()
            .max_connections(options.pool)
            .connect(&options.store)
            .await?;
        let mut connection = store.pool().get().await?;
        diesel_async::RunQueryDsl::execute(
            diesel::sql_query(
                "CREATE TABLE IF NOT EXISTS bench_charges (id INTEGER PRIMARY KEY, amount BIGINT NOT NULL)",
            ),
            &mut *connection,
        )
        .await?;
        drop(connection);
        return Ok(if options.transactional {
            Writes::SqliteInTransaction
        } else {
            Writes::SqliteOnItsOwn(store.pool().clone())
        });
    }
    let outbox = staging_outbox(options).await?;
    if options.write {
        if !options.transactional {
            return Err("--write on PostgreSQL needs --transactional".into());
        }
        create_charges(&options.store).await?;
    }
    if outbox.is_none() && !options.write {
        return Ok(Writes::Nothing);
    }
    Ok(Writes::Postgres {
        outbox,
        row: options.write,
    })
}

/// With `--write`: the table the handler writes its row in.
async fn create_charges(url: &str) -> Result<(), BoxError> {
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
    let mut connection = AsyncPgConnection::establish(url).await?;
    diesel::sql_query(
        "CREATE TABLE IF NOT EXISTS bench_charges (id bigserial PRIMARY KEY, amount bigint NOT NULL)",
    )
    .execute(&mut connection)
    .await?;
    Ok(())
}

/// The store the options name, migrated or prefilled.
async fn open_store(options: &Options) -> Result<Arc<dyn Store>, BoxError> {
    if options.store == "memory" {
        // Room for the prefill on top of the defaults, so that the measured
        // requests never evict.
        let store = MemoryStore::builder()
            .max_records(1_000_000 + options.prefill)
            .max_bytes((512 << 20) + options.prefill * 1024)
            .build();
        prefill(&store, options.prefill).await?;
        return Ok(Arc::new(store));
    }
    if options.store.starts_with("redis") {
        return Ok(Arc::new(
            idem_redis::RedisStore::connect(&options.store).await?,
        ));
    }
    if options.store.starts_with("sqlite") {
        let store = SqliteStore::builder()
            .max_connections(options.pool)
            .connect(&options.store)
            .await?;
        store.migrate().await?;
        if options.transactional {
            return Ok(Arc::new(store.transactional()));
        }
        return Ok(Arc::new(store));
    }
    let store = PgStore::builder()
        .max_connections(options.pool)
        .connect(&options.store)
        .await?;
    store.migrate().await?;
    if options.transactional {
        return Ok(Arc::new(store.transactional()));
    }
    Ok(Arc::new(store))
}

/// Completes `records` records with 200-byte bodies.
pub(crate) async fn prefill(store: &MemoryStore, records: usize) -> Result<(), BoxError> {
    let body = "x".repeat(PREFILL_BODY);
    let response = idem_core::StoredResponse::new(
        handler::STATUS,
        vec![idem_core::Header::new("content-type", CONTENT_TYPE)],
        body,
    );
    for i in 0..records {
        let request = ClaimRequest {
            scope: Scope::new(format!("tenant-{}", i % 100)),
            key: IdempotencyKey::new(&uuid::Uuid::new_v4().to_string())?,
            fingerprint: Fingerprint::from_bytes([1; 32]),
            owner: OwnerToken::random(),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
        };
        let ClaimOutcome::Claimed(claim) = store.claim(&request).await? else {
            return Err("a fresh key was not claimed".into());
        };
        store.complete(&claim, &response, request.retention).await?;
    }
    Ok(())
}

fn announce(listener: &TcpListener) -> Result<(), BoxError> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on http://{}", listener.local_addr()?)?;
    stdout.flush()?;
    Ok(())
}

async fn axum_server(
    listener: TcpListener,
    store: Arc<dyn Store>,
    writes: Writes,
) -> Result<(), BoxError> {
    use axum::Router;
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    use idem_axum::IdempotencyLayer;

    async fn charge(body: bytes::Bytes) -> impl axum::response::IntoResponse {
        handler::executed();
        (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, CONTENT_TYPE)],
            handler::answer(body.len()),
        )
    }

    async fn slow_charge(body: bytes::Bytes) -> impl axum::response::IntoResponse {
        tokio::time::sleep(handler::SLOW).await;
        charge(body).await
    }

    /// The charge, after its own row (`write`) and its event (`outbox`) in
    /// the request's transaction: both pipelined when there are both.
    async fn transactional_charge(
        outbox: Option<PgOutbox>,
        write: bool,
        transaction: Transaction,
        body: bytes::Bytes,
    ) -> axum::response::Response {
        use diesel::sql_types::BigInt;
        use diesel_async::RunQueryDsl;

        let connection = match transaction.connection().await {
            Ok(connection) => connection,
            Err(ended) => {
                return (StatusCode::INTERNAL_SERVER_ERROR, ended.to_string()).into_response();
            }
        };
        let event = crate::outbox::charge_event();
        let mut shared = &*connection;
        let insert = async {
            if !write {
                return Ok(());
            }
            diesel::sql_query("INSERT INTO bench_charges (amount) VALUES ($1)")
                .bind::<BigInt, _>(100)
                .execute(&mut shared)
                .await
                .map(drop)
        };
        let stage = async {
            match &outbox {
                Some(outbox) => outbox.stage(&connection, &event).await,
                None => Ok(()),
            }
        };
        match tokio::join!(insert, stage) {
            (Ok(()), Ok(())) => charge(body).await.into_response(),
            (Err(error), _) | (_, Err(error)) => {
                (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
            }
        }
    }

    /// The charge, after its row written in the request's SQLite transaction.
    async fn sqlite_transactional_charge(
        StoreContext(transaction): StoreContext<SqliteTransaction>,
        body: bytes::Bytes,
    ) -> axum::response::Response {
        let written = transaction
            .write(|c| {
                diesel::RunQueryDsl::execute(
                    diesel::sql_query("INSERT INTO bench_charges (amount) VALUES (100)"),
                    c,
                )
                .map_err(SqliteTransactionError::from)
            })
            .await;
        match written {
            Ok(_) => charge(body).await.into_response(),
            Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
        }
    }

    /// The charge, after its row written on its own (a handler over the
    /// plain store), as a task of its own (see `SqliteStore`).
    async fn sqlite_plain_charge(pool: SqlitePool, body: bytes::Bytes) -> axum::response::Response {
        let written = tokio::spawn(async move {
            let mut connection = pool.get_owned().await.map_err(|e| e.to_string())?;
            diesel_async::RunQueryDsl::execute(
                diesel::sql_query("INSERT INTO bench_charges (amount) VALUES (100)"),
                &mut *connection,
            )
            .await
            .map_err(|e| e.to_string())
        })
        .await;
        match written {
            Ok(Ok(_)) => charge(body).await.into_response(),
            Ok(Err(error)) => (StatusCode::INTERNAL_SERVER_ERROR, error).into_response(),
            Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
        }
    }

    let layer =
        IdempotencyLayer::from_engine(idem_core::Engine::from_shared(store, Policy::required()))
            .scope_with(|_| Some(Scope::new(SCOPE)));
    let layered = match writes {
        Writes::Nothing => post(charge).route_layer(layer.clone()),
        Writes::Postgres { outbox, row } => layer.on(
            axum::http::Method::POST,
            move |transaction: Transaction, body: bytes::Bytes| {
                transactional_charge(outbox.clone(), row, transaction, body)
            },
        )?,
        Writes::SqliteInTransaction => {
            layer.on(axum::http::Method::POST, sqlite_transactional_charge)?
        }
        Writes::SqliteOnItsOwn(pool) => {
            post(move |body: bytes::Bytes| sqlite_plain_charge(pool.clone(), body))
                .route_layer(layer.clone())
        }
    };
    let app = Router::new()
        .route("/bare", post(charge))
        .route("/layered", layered)
        .route("/layered-slow", post(slow_charge).route_layer(layer))
        .route(
            "/executions",
            get(|| async { handler::executions().to_string() }),
        );
    announce(&listener)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    axum::serve(listener, app).await?;
    Ok(())
}

async fn actix_server(
    listener: TcpListener,
    store: Arc<dyn Store>,
    workers: usize,
) -> Result<(), BoxError> {
    use actix_web::{App, HttpResponse, HttpServer, web};
    use idem_actix::Idempotency;

    async fn charge(body: web::Bytes) -> HttpResponse {
        handler::executed();
        HttpResponse::Created()
            .content_type(CONTENT_TYPE)
            .body(handler::answer(body.len()))
    }

    let engine = idem_core::Engine::from_shared(store, Policy::required());
    announce(&listener)?;
    HttpServer::new(move || {
        App::new().route("/bare", web::post().to(charge)).service(
            web::resource("/layered")
                .wrap(
                    Idempotency::from_engine(engine.clone())
                        .scope_with(|_| Some(Scope::new(SCOPE))),
                )
                .route(web::post().to(charge)),
        )
    })
    .workers(workers.max(1))
    .listen(listener)?
    .run()
    .await?;
    Ok(())
}
