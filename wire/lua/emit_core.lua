-- Shared by the scripts that write a session event (loaded in front of each).
local function emit(events, gen, channel, maxlen, ttl, etype, gid, data)
  local id = redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 't', etype, 'g', gid, 'd', data)
  redis.call('PUBLISH', channel, id .. ' ' .. etype .. ' ' .. gid .. ' ' .. data)
  return id
end
local function finish(gen, active, gid, state, id, data, ttl)
  redis.call('HSET', gen, 'state', state, 'final_id', id, 'final', data)
  redis.call('EXPIRE', gen, ttl)
  if redis.call('GET', active) == gid then redis.call('DEL', active) end
end
