-- KEYS[1] record. Answers {0} absent or expired,
-- {2, fingerprint, expires_at, lease_until, owner} in progress, or
-- {3, fingerprint, expires_at, status, headers, body, replayable} completed.
local key = KEYS[1]
local now = now_ms()
local found = redis.call('HMGET', key, 'e', 'l', 'f', 'o', 's', 'h', 'b', 'r')
local expires_at = tonumber(found[1])
if not expires_at then
  return {0}
end
local lease_until = tonumber(found[2])
if expired(now, expires_at, lease_until) then
  return {0}
end
if lease_until then
  return {2, found[3], expires_at, lease_until, found[4]}
end
return {3, found[3], expires_at, tonumber(found[5]), found[6], found[7], tonumber(found[8])}
