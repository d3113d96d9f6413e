-- The transactional outbox of idem-diesel's `Outbox` on SQLite: events
-- staged in the application's transactions, published by a relay.
-- `position` orders them (AUTOINCREMENT: never reused, even after the cleanup
-- deleted the last one); `id` is the event's id (a hyphenated UUID), its
-- message id on the broker. Times are microseconds since the Unix epoch.
CREATE TABLE IF NOT EXISTS "idem_outbox" (
    position        INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT    NOT NULL UNIQUE,
    destination     TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    headers         BLOB    NOT NULL,
    staged_at       INTEGER NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL,
    sent_at         INTEGER,
    parked_at       INTEGER,
    reason          TEXT
);
CREATE INDEX IF NOT EXISTS "idem_outbox_unsent"
    ON "idem_outbox" (position) WHERE sent_at IS NULL AND parked_at IS NULL;
CREATE INDEX IF NOT EXISTS "idem_outbox_unsent_key"
    ON "idem_outbox" (destination, key, position) WHERE sent_at IS NULL AND parked_at IS NULL;
CREATE INDEX IF NOT EXISTS "idem_outbox_sent_at"
    ON "idem_outbox" (sent_at) WHERE sent_at IS NOT NULL;
-- What `Outbox::parked` lists; the cleanup job keeps them.
CREATE INDEX IF NOT EXISTS "idem_outbox_parked"
    ON "idem_outbox" (parked_at) WHERE parked_at IS NOT NULL;
