-- KEYS: the model's fair base (Keys.fair)
-- ARGV: how long a name is held (s), the worker, then the names of the prefixes a request it
--       ran left in its engine's cache (wire/prefixes.py held)
-- Adds the worker to each name's holders (fair_holders, fair_core.lua): a request that
-- names one of them is taken by it first. A name nobody adds again is forgotten after the
-- TTL: a stale name costs a prefill somewhere, never a reply.
local base, ttl, worker = KEYS[1], ARGV[1], ARGV[2]
for i = 3, #ARGV do
  local holders = base .. ':h:' .. ARGV[i]
  redis.call('SADD', holders, worker)
  redis.call('EXPIRE', holders, ttl)
end
return 1
