-- KEYS: gen, events, active
-- ARGV: channel, maxlen, ttl, gid, reason, cancelled event JSON (for a queued generation)
-- Returns {'unknown'} | {'final', state, final JSON} | {'cancelled', id, JSON} | {'signal', worker}
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
if redis.call('HEXISTS', KEYS[1], 'final_id') == 1 then
  return {'final', state, redis.call('HGET', KEYS[1], 'final')}
end
redis.call('HSET', KEYS[1], 'cancel', ARGV[5])
if state == 'queued' then
  -- Not running: end it here, so the worker that dequeues it skips it. One queued again
  -- after a takeover counts what it streamed before (the usage its takeover recorded).
  local data = ARGV[6]
  local usage = redis.call('HGET', KEYS[1], 'usage')
  if usage then
    local event = cjson.decode(data)
    event['usage'] = cjson.decode(usage)
    data = cjson.encode(event)
  end
  local id = emit(KEYS[2], KEYS[1], ARGV[1], ARGV[2], ARGV[3], 'cancelled', ARGV[4], data)
  finish(KEYS[1], KEYS[3], ARGV[4], 'cancelled', id, data, ARGV[3])
  return {'cancelled', id, data}
end
return {'signal', redis.call('HGET', KEYS[1], 'worker') or ''}
