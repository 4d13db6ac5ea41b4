-- KEYS: the tenant's requests and running keys
-- ARGV: the generation ids ADMIT admitted (space-separated; the first names the request),
--       '1' when it counted the request
-- Gives back what ADMIT took for generations that were not queued after all (the submit
-- was refused: busy session, capacity, a resend's Idempotency-Key; or its gateway was lost
-- before it, gateway/recovery/admissions.py): they ran nothing.
local sessions = string.sub(KEYS[2], 1, -8) .. 'sessions'  -- 'running'
local first = true
for gid in string.gmatch(ARGV[1], '%S+') do
  if first and ARGV[2] == '1' then redis.call('ZREM', KEYS[1], gid) end
  first = false
  redis.call('ZREM', KEYS[2], gid)
  redis.call('HDEL', sessions, gid)
end
return 1
