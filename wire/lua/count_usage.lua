-- KEYS: the tenant's requests key (it names the tenant's slot; the keys counted are its
--       siblings)
-- ARGV: the generation id, what to bill ('all', 'completion', 'none'), its usage JSON
--       ('' when none is known), what its key's limits keep besides (add_usage's counts)
-- On a Redis Cluster, where the tenant's keys are on a slot of their own, the writer of a
-- generation's final event counts its usage right after it (wire/tenancy.py), once: a
-- generation already counted is skipped (a marker per generation id, kept a day).
-- Returns 1 when it counted, 0 when it had been counted before.
local base = string.sub(KEYS[1], 1, -9)  -- 'requests'
local now = tonumber(redis.call('TIME')[1])
local counted = base .. 'counted'
redis.call('ZREMRANGEBYSCORE', counted, '-inf', now - 86400)
if redis.call('ZADD', counted, 'NX', now, ARGV[1]) == 0 then return 0 end
redis.call('EXPIRE', counted, 86400)
local usage = nil
if ARGV[3] ~= '' then usage = cjson.decode(ARGV[3]) end
add_usage(base, ARGV[1], ARGV[2], usage, ARGV[4])
return 1
