-- KEYS: lock
-- ARGV: owner, ttl in ms
-- Takes the lock for its owner, or keeps it (a new ttl) when that owner holds it: one round
-- trip per pass, and no window in which an expiring lock taken by another is extended.
-- Returns 1 when the owner holds it now, 0 when another does.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
