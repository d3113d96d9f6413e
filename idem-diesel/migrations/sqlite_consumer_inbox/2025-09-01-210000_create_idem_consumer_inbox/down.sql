DROP TABLE IF EXISTS "idem_consumer_dead_letters";
DROP TABLE IF EXISTS "idem_consumer_failures";
DROP TABLE IF EXISTS "idem_consumer_inbox";
