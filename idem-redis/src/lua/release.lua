-- KEYS[1] record; ARGV: owner. Answers 1, or 0 when stale.
local key = KEYS[1]
local now = now_ms()
local found = redis.call('HMGET', key, 'o', 'l', 'e')
if not held_by(found[1], tonumber(found[2]), tonumber(found[3]), ARGV[1], now) then
  return 0
end
redis.call('DEL', key)
return 1
