-- The transactional outbox of idem-diesel's `Outbox` on PostgreSQL: events
-- staged in the application's transactions, published by a relay.
-- `position` orders them (per destination and key, the relay keeps it);
-- `id` is the event's id, its message id on the broker.
CREATE TABLE IF NOT EXISTS "idem_outbox" (
    position        bigserial   PRIMARY KEY,
    id              uuid        NOT NULL UNIQUE,
    destination     text        NOT NULL,
    key             text        NOT NULL,
    payload         bytea       NOT NULL,
    headers         bytea       NOT NULL,
    staged_at       timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz,
    parked_at       timestamptz,
    reason          text
);
-- The unsent events, in order: what the relay looks at.
CREATE INDEX IF NOT EXISTS "idem_outbox_unsent"
    ON "idem_outbox" (position) WHERE sent_at IS NULL AND parked_at IS NULL;
-- An event's turn: no earlier unsent event of its destination and key.
CREATE INDEX IF NOT EXISTS "idem_outbox_unsent_key"
    ON "idem_outbox" (destination, key, position) WHERE sent_at IS NULL AND parked_at IS NULL;
-- What the cleanup job deletes.
CREATE INDEX IF NOT EXISTS "idem_outbox_sent_at"
    ON "idem_outbox" (sent_at) WHERE sent_at IS NOT NULL;
-- What `Outbox::parked` lists; the cleanup job keeps them.
CREATE INDEX IF NOT EXISTS "idem_outbox_parked"
    ON "idem_outbox" (parked_at) WHERE parked_at IS NOT NULL;
