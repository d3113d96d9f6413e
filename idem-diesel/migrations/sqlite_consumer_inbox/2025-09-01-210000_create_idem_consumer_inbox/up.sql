-- The consumer inbox of `SqliteInbox` (idem_core::consume): which messages
-- each consumer applied (with the message's fingerprint), the failed attempts
-- of those it has not applied yet, and the dead letters. Times are
-- microseconds since the Unix epoch; `attempted_at` lists every failed
-- attempt's start, comma-separated, in order.
CREATE TABLE IF NOT EXISTS "idem_consumer_inbox" (
    consumer     TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    fingerprint  BLOB    NOT NULL,
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "idem_consumer_inbox_processed_at"
    ON "idem_consumer_inbox" (processed_at);

CREATE TABLE IF NOT EXISTS "idem_consumer_failures" (
    consumer        TEXT    NOT NULL,
    message_id      TEXT    NOT NULL,
    attempts        INTEGER NOT NULL CHECK (attempts > 0),
    attempted_at    TEXT    NOT NULL,
    last_attempt_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "idem_consumer_failures_last_attempt_at"
    ON "idem_consumer_failures" (last_attempt_at);

CREATE TABLE IF NOT EXISTS "idem_consumer_dead_letters" (
    consumer     TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    reason       TEXT    NOT NULL,
    attempts     INTEGER NOT NULL CHECK (attempts > 0),
    attempted_at TEXT    NOT NULL,
    dead_at      INTEGER NOT NULL,
    published    INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "idem_consumer_dead_letters_dead_at"
    ON "idem_consumer_dead_letters" (consumer, dead_at, message_id);
