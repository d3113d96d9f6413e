-- The consumer inbox: which messages each consumer processed, the failures of
-- those it has not processed yet, and the dead letters.
CREATE TABLE IF NOT EXISTS "idem_inbox" (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "idem_inbox_processed_at" ON "idem_inbox" (processed_at);

CREATE TABLE IF NOT EXISTS "idem_inbox_failures" (
    consumer        text          NOT NULL,
    message_id      text          NOT NULL,
    attempts        integer       NOT NULL CHECK (attempts > 0),
    last_error      text          NOT NULL,
    attempted_at    timestamptz[] NOT NULL,
    last_attempt_at timestamptz   NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "idem_inbox_failures_last_attempt_at"
    ON "idem_inbox_failures" (last_attempt_at);

CREATE TABLE IF NOT EXISTS "idem_dead_letters" (
    consumer     text          NOT NULL,
    message_id   text          NOT NULL,
    attempts     integer       NOT NULL CHECK (attempts > 0),
    last_error   text          NOT NULL,
    attempted_at timestamptz[] NOT NULL,
    dead_at      timestamptz   NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
