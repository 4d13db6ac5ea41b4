-- Every event of one engine step (of one hash slot's sessions, on a cluster) in one call.
-- KEYS: per event its session's events and gen keys; a final event's also active, history;
--   then, when ARGV[2] names requests, their queue; then, when ARGV[4] names prefixes, the
--   model's fair base
-- ARGV[1]: the writer (the worker's id); ARGV[2]: the entry ids, space-separated, of the
--   requests whose generations ended here ('' for none), acknowledged for the consumer
--   group ARGV[3] once every event is written; ARGV[4]: '' or "<ttl> <name> <name>...",
--   the prefixes the replies that ended here left in the writer's engine, the writer
--   added to their holders (hold_prefix) with their final events, so a client's next turn
--   finds them (one Redis: a cluster's worker acknowledges after the call, and holds
--   before it: FAIR_HOLD); then per event one record
--   "<epoch> <maxlen> <ttl> <gid> <seq> <type> <final state or -> <event JSON>"
--   (seq 0: no retry check)
-- and, after a final event's record, the assistant message JSON ('' for none).
-- Returns one reply per event, in order: its entry id, or '' when refused (as EMIT).
-- The live channel is the events key with 'live' for 'events' (wire/keys.py).
local writer, out, k, a = ARGV[1], {}, 1, 5
holding = true  -- a session's events of this step go in one live message (emit_core.lua)
while a <= #ARGV do
  local epoch, maxlen, ttl, gid, seq, etype, state, data =
    string.match(ARGV[a], '^(%d+) (%d+) (%d+) (%S+) (%d+) (%S+) (%S+) (.*)$')
  if not data then
    publish_held()  -- the events written before it
    return redis.error_reply('EMIT_STEP: bad record ' .. a)
  end
  local events, gen = KEYS[k], KEYS[k + 1]
  local active, history, assistant = '', '', ''
  k, a = k + 2, a + 1
  if state == '-' then
    state = ''
  else
    active, history, assistant = KEYS[k], KEYS[k + 1], ARGV[a]
    k, a = k + 2, a + 1
  end
  seq = tonumber(seq)
  if seq == 0 then seq = nil end
  local channel = string.sub(events, 1, -7) .. 'live'
  out[#out + 1] = emit_event(events, gen, active, history, channel, maxlen, ttl, etype, gid,
                             data, state, writer, assistant, seq, tonumber(epoch)) or ''
end
publish_held()
if ARGV[2] ~= '' then
  local ids = {}
  for id in string.gmatch(ARGV[2], '%S+') do ids[#ids + 1] = id end
  for i = 1, #ids, 1000 do  -- unpack's limit: a few thousand values
    redis.call('XACK', KEYS[k], ARGV[3], unpack(ids, i, math.min(i + 999, #ids)))
  end
  k = k + 1
end
if ARGV[4] ~= '' then
  local ttl = string.match(ARGV[4], '^%d+')
  for name in string.gmatch(string.sub(ARGV[4], #ttl + 2), '%S+') do
    hold_prefix(KEYS[k], writer, ttl, name)
  end
end
return out
