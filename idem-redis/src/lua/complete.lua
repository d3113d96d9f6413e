-- KEYS[1] record; ARGV: owner, status, headers, body, replayable (1 or 0),
-- retention ms, grace ms. Answers 1, or 0 when stale.
local key = KEYS[1]
local now = now_ms()
local found = redis.call('HMGET', key, 'o', 'l', 'e', 'f')
if not held_by(found[1], tonumber(found[2]), tonumber(found[3]), ARGV[1], now) then
  return 0
end
local new_expiry = now + tonumber(ARGV[6])
redis.call('DEL', key)
redis.call('HSET', key, 'f', found[4], 's', ARGV[2], 'h', ARGV[3], 'b', ARGV[4], 'r', ARGV[5],
  'e', int(new_expiry))
keep(key, now, new_expiry, nil, ARGV[7])
return 1
