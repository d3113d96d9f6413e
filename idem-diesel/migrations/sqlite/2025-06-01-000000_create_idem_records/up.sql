CREATE TABLE IF NOT EXISTS "idem_records" (
    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    fingerprint BLOB    NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN ('in_progress', 'completed')),
    owner       BLOB,
    lease_until INTEGER,
    status      INTEGER,
    headers     BLOB,
    body        BLOB,
    replayable  INTEGER,
    expires_at  INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (scope, key),
    CHECK (state <> 'in_progress' OR (owner IS NOT NULL AND lease_until IS NOT NULL)),
    CHECK (state <> 'completed' OR (status IS NOT NULL AND headers IS NOT NULL
                                    AND body IS NOT NULL AND replayable IS NOT NULL))
);
CREATE INDEX IF NOT EXISTS "idem_records_expires_at" ON "idem_records" (expires_at);
