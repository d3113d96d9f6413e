-- KEYS[1] record; ARGV: fingerprint, owner, lease ms, retention ms, grace ms.
-- Answers {1} claimed, {2, fingerprint, lease_until} in progress, or
-- {3, fingerprint, status, headers, body, replayable} completed.
local key = KEYS[1]
local now = now_ms()
local found = redis.call('HMGET', key, 'e', 'l', 'f', 's', 'h', 'b', 'r')
local expires_at = tonumber(found[1])
if expires_at then
  local lease_until = tonumber(found[2])
  if lease_until then
    if now < lease_until then
      return {2, found[3], lease_until}
    end
  elseif now < expires_at then
    return {3, found[3], tonumber(found[4]), found[5], found[6], tonumber(found[7])}
  end
end
-- New: absent, expired, or its lease lapsed.
local lease_until = now + tonumber(ARGV[3])
local new_expiry = now + tonumber(ARGV[4])
redis.call('DEL', key)
redis.call('HSET', key, 'f', ARGV[1], 'o', ARGV[2], 'l', int(lease_until), 'e', int(new_expiry))
keep(key, now, new_expiry, lease_until, ARGV[5])
return {1}
