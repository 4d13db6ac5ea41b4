-- Shared by the scripts that write a session event (loaded in front of each).
-- PUBLISH on one Redis; SPUBLISH on a cluster (wire/scripts.py swaps this line), so the
-- live channel, tagged like the session's keys, goes to this slot's shard only.
local publish = 'PUBLISH'
local function emit(events, gen, channel, maxlen, ttl, etype, gid, data)
  local id = redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 't', etype, 'g', gid, 'd', data)
  redis.call(publish, channel, id .. ' ' .. etype .. ' ' .. gid .. ' ' .. data)
  return id
end
-- Every script that writes a final event calls this, once per generation (a second final
-- is refused before it), so the generation's usage is counted here (usage_core.lua).
local function finish(gen, active, gid, state, id, data, ttl)
  redis.call('HSET', gen, 'state', state, 'final_id', id, 'final', data)
  count_usage(gen, gid, data)
  redis.call('EXPIRE', gen, ttl)
  if redis.call('GET', active) == gid then redis.call('DEL', active) end
end
