-- Shared by every script of the store (prepended to each).
--
-- A record is one hash: f = fingerprint, e = expires_at (ms since the Unix
-- epoch, server clock); in progress: o = owner token, l = lease_until;
-- completed: s = status, h = headers, b = body, r = replayable (1 or 0).

-- The server's clock, in milliseconds since the Unix epoch.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A whole number as Redis reads it (tostring would give 1.7e+12).
local function int(n)
  return string.format('%.0f', n)
end

-- Expired: past its retention and, when in progress, past its lease too (an
-- in-progress record is never expired while its lease lives).
local function expired(now, expires_at, lease_until)
  return now >= expires_at and (lease_until == nil or now >= lease_until)
end

-- Redis deletes the hash `grace` ms after the later of its expiry and lease.
local function keep(key, now, expires_at, lease_until, grace)
  local until_ms = expires_at
  if lease_until ~= nil and lease_until > until_ms then
    until_ms = lease_until
  end
  redis.call('PEXPIRE', key, int(until_ms - now + tonumber(grace)))
end

-- Whether `owner` holds the record in progress: an owner whose lease lapsed
-- still holds it until another request claims it or it expires.
local function held_by(found_owner, lease_until, expires_at, owner, now)
  return found_owner == owner and lease_until ~= nil and expires_at ~= nil
    and not expired(now, expires_at, lease_until)
end

