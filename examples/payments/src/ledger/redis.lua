-- The payments ledger on Redis: applies one operation to one account, in one
-- slot (every key shares the account's hash tag).
--
-- KEYS[1] the account (hash: balance, operations), KEYS[2] its operations
-- (list, oldest first), KEYS[3] the marker of the request's idempotency key
-- (string, "ID BALANCE"; any key for an unkeyed request).
-- ARGV[1] the amount, ARGV[2] the operation's id, ARGV[3] "1" when keyed,
-- ARGV[4] the marker's lifetime in ms (the records' retention), ARGV[5] the
-- operation's JSON up to its balance_after value.
--
-- Answers {"applied", "ID BALANCE"} for an operation this call applied,
-- {"earlier", "ID BALANCE"} when the key's operation was applied before (a
-- retry after a crash between this write and the idempotency record's
-- completion), {"overflow"} when the balance would leave 64 bits.
local keyed = ARGV[3] == '1'
if keyed then
  local earlier = redis.call('GET', KEYS[3])
  if earlier then
    return {'earlier', earlier}
  end
end
local added = redis.pcall('HINCRBY', KEYS[1], 'balance', ARGV[1])
if type(added) == 'table' and added.err then
  return {'overflow'}
end
redis.call('HINCRBY', KEYS[1], 'operations', 1)
-- Read back as a string: Lua numbers are doubles, balances 64-bit integers.
local balance = redis.call('HGET', KEYS[1], 'balance')
redis.call('RPUSH', KEYS[2], ARGV[5] .. balance .. '}')
local applied = ARGV[2] .. ' ' .. balance
if keyed then
  redis.call('SET', KEYS[3], applied, 'PX', ARGV[4])
end
return {'applied', applied}
