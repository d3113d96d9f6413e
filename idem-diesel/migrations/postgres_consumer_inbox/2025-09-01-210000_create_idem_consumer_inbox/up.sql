-- The consumer inbox of `PgInbox` (idem_core::consume): which messages each
-- consumer applied (with the message's fingerprint), the failed attempts of
-- those it has not applied yet, and the dead letters.
CREATE TABLE IF NOT EXISTS "idem_consumer_inbox" (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "idem_consumer_inbox_processed_at"
    ON "idem_consumer_inbox" (processed_at);

-- One row per message with failed attempts: when each started, in order.
CREATE TABLE IF NOT EXISTS "idem_consumer_failures" (
    consumer        text          NOT NULL,
    message_id      text          NOT NULL,
    attempted_at    timestamptz[] NOT NULL,
    last_attempt_at timestamptz   NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "idem_consumer_failures_last_attempt_at"
    ON "idem_consumer_failures" (last_attempt_at);

CREATE TABLE IF NOT EXISTS "idem_consumer_dead_letters" (
    consumer     text          NOT NULL,
    message_id   text          NOT NULL,
    reason       text          NOT NULL,
    attempted_at timestamptz[] NOT NULL,
    dead_at      timestamptz   NOT NULL DEFAULT now(),
    published    boolean       NOT NULL DEFAULT false,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "idem_consumer_dead_letters_dead_at"
    ON "idem_consumer_dead_letters" (consumer, dead_at, message_id);
