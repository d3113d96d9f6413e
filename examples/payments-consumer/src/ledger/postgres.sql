-- payments-consumer's ledger on PostgreSQL: applied at start (idempotent).
-- Each account's balance and how many payments made it.
CREATE TABLE IF NOT EXISTS payments_consumer_accounts (
    account_id text   PRIMARY KEY,
    balance    bigint NOT NULL,
    operations bigint NOT NULL
);
