-- KEYS[1] a key under the store's prefix. Deletes it when it is an expired
-- record (Redis would, `grace` later). Answers 1 when deleted, else 0.
local key = KEYS[1]
if redis.call('TYPE', key).ok ~= 'hash' then
  return 0
end
local found = redis.call('HMGET', key, 'e', 'l')
local expires_at = tonumber(found[1])
if not expires_at or not expired(now_ms(), expires_at, tonumber(found[2])) then
  return 0
end
redis.call('DEL', key)
return 1
