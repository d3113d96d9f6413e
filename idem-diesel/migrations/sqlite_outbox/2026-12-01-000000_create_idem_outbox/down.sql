DROP TABLE IF EXISTS "idem_outbox";
