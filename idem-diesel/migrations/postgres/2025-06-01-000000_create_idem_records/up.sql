CREATE TABLE IF NOT EXISTS "idem_records" (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    state       text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    owner       uuid,
    lease_until timestamptz,
    status      integer,
    headers     bytea,
    body        bytea,
    replayable  boolean,
    expires_at  timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, key),
    CHECK (state <> 'in_progress' OR (owner IS NOT NULL AND lease_until IS NOT NULL)),
    CHECK (state <> 'completed' OR (status IS NOT NULL AND headers IS NOT NULL
                                    AND body IS NOT NULL AND replayable IS NOT NULL))
);
CREATE INDEX IF NOT EXISTS "idem_records_expires_at" ON "idem_records" (expires_at);
