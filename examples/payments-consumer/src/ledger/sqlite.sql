-- payments-consumer's ledger on SQLite: applied at start (idempotent).
-- Each account's balance and how many payments made it. STRICT: a value that
-- is not a 64-bit integer (SQLite turns an overflowing sum into a REAL) is
-- refused, not stored.
CREATE TABLE IF NOT EXISTS payments_consumer_accounts (
    account_id TEXT    PRIMARY KEY NOT NULL,
    balance    INTEGER NOT NULL,
    operations INTEGER NOT NULL
) STRICT;
