-- The payments ledger on PostgreSQL, in the idempotency store's database: the
-- accounts and every operation applied to them. Run at every start-up, by every
-- instance: the lock makes concurrent runs take turns, and every statement is
-- IF NOT EXISTS. (Several statements in one simple query are one transaction,
-- which holds the transaction-scoped lock to its end.)
SELECT pg_advisory_xact_lock(hashtext('payments ledger migration'));

CREATE TABLE IF NOT EXISTS payment_accounts (
    account_id text PRIMARY KEY,
    -- The sum of every amount applied.
    balance bigint NOT NULL,
    -- How many charges and deposits were applied.
    operations bigint NOT NULL
);

-- One row per operation applied. No unique constraint on the idempotency key:
-- the idempotency layer is what makes a charge take effect once, and this table
-- records what happened, so a second effect would show here.
CREATE TABLE IF NOT EXISTS payment_operations (
    id uuid PRIMARY KEY,
    account_id text NOT NULL REFERENCES payment_accounts (account_id),
    kind text NOT NULL CHECK (kind IN ('charge', 'deposit')),
    amount bigint NOT NULL,
    currency text NOT NULL,
    balance_after bigint NOT NULL,
    -- The principal and the Idempotency-Key of the request, when it had one.
    idempotency_scope text,
    idempotency_key text,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS payment_operations_account
    ON payment_operations (account_id, created_at);
