DROP TABLE IF EXISTS "idem_dead_letters";
DROP TABLE IF EXISTS "idem_inbox_failures";
DROP TABLE IF EXISTS "idem_inbox";
