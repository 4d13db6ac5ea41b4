-- `worker` among the holders of the prefix `name` under the model's fair base (fair_holders,
-- fair_core.lua, reads them): a request that names it is taken by that worker first. A name
-- nobody adds again is forgotten after `ttl` s: a stale name costs a prefill somewhere,
-- never a reply.
local function hold_prefix(base, worker, ttl, name)
  local holders = base .. ':h:' .. name
  redis.call('SADD', holders, worker)
  redis.call('EXPIRE', holders, ttl)
end
