-- The payments ledger on SQLite, in the idempotency store's file: the accounts
-- and every operation applied to them. Run at every start-up in one immediate
-- transaction; every statement is IF NOT EXISTS.
CREATE TABLE IF NOT EXISTS payment_accounts (
    account_id TEXT PRIMARY KEY NOT NULL,
    -- The sum of every amount applied.
    balance INTEGER NOT NULL,
    -- How many charges and deposits were applied.
    operations INTEGER NOT NULL
);

-- One row per operation applied. A keyed request's operation is looked up by
-- its scope and key before applying (src/ledger/sqlite.rs says why), within
-- the records' retention; no unique constraint, so a key reused after its
-- retention applies again, as the idempotency layer allows.
CREATE TABLE IF NOT EXISTS payment_operations (
    id TEXT PRIMARY KEY NOT NULL,
    account_id TEXT NOT NULL REFERENCES payment_accounts (account_id),
    kind TEXT NOT NULL CHECK (kind IN ('charge', 'deposit')),
    amount INTEGER NOT NULL,
    currency TEXT NOT NULL,
    balance_after INTEGER NOT NULL,
    -- The principal and the Idempotency-Key of the request, when it had one.
    idempotency_scope TEXT,
    idempotency_key TEXT,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE INDEX IF NOT EXISTS payment_operations_account
    ON payment_operations (account_id, created_at);

CREATE INDEX IF NOT EXISTS payment_operations_key
    ON payment_operations (idempotency_scope, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
