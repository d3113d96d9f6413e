-- KEYS[1] record; ARGV: owner, lease ms, grace ms. Answers 1, or 0 when stale.
local key = KEYS[1]
local now = now_ms()
local found = redis.call('HMGET', key, 'o', 'l', 'e')
local lease_until, expires_at = tonumber(found[2]), tonumber(found[3])
if not held_by(found[1], lease_until, expires_at, ARGV[1], now) then
  return 0
end
local renewed = now + tonumber(ARGV[2])
redis.call('HSET', key, 'l', int(renewed))
keep(key, now, expires_at, renewed, ARGV[3])
return 1
